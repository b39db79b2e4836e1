"""A plan's process groups as data: which ranks, which backend, in which order every rank creates them.

Why data, and why here (torch-free): the runtime creates exactly these groups (``hethub.runtime.grid``), and the
NCCL-order replay (``partitioner.ordering``) checks a schedule against exactly the same assignment of transfers to
groups, so what is proven deadlock-free before launch is what runs.

The rules, one home each:

- **Backend.** A group whose ranks span vendors is gloo (NVIDIA's NCCL and AMD's RCCL do not talk to each other);
  so is a boundary whose ``transport`` is ``"host"`` (the bridge). Every other group is the accelerator's backend
  (NCCL/RCCL on GPUs; gloo on CPU). The world group is gloo when the plan spans vendors.
- **Point-to-point.** Each (boundary, direction) has its own group (a boundary follows a pipeline chunk: with
  several chunks per device group, the boundary from the last group back to the first has its own too; zb-v's
  turn, where one group holds both chunks, needs none: each replica hands its rows to itself): activations (and their metadata) travel on the
  boundary's forward group, gradients on its backward group. NCCL runs a communicator's operations in issue order on
  one stream; with both directions on one group, stage s's ``recv G0`` waits behind stage s+1's ``recv A1`` and
  vice versa (every plan with two stages and two micro-batches deadlocks). A group's operations stay in the order
  the schedule posts them: that order is part of the schedule's contract, and ``ordering.check_order`` proves it.
- **Bounded sends.** A rank keeps at most ``SEND_WINDOW`` unfinished sends per (direction, peer); the next one
  waits for the oldest. A send holds its packed buffer until it completes, which takes the receiver posting its
  receive: a stage running ahead of its neighbour would otherwise hold one buffer per micro-batch. The replay
  proves the product's schedules finish under the bound.
- **Control.** Small control messages (checks, agreements, loss and norm scalars, barriers) go over one gloo group
  on host tensors (``CONTROL``), whatever the accelerator: they never meet NCCL's ordering or a vendor boundary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .records import Plan

GLOO, ACCEL = "gloo", "accelerator"
SEND_WINDOW = 2  # unfinished sends a rank keeps per (direction, peer)
CONTROL = "control"


@dataclass(frozen=True)
class GroupSpec:
    """One process group: what it is for, its ranks (ascending), and its backend (``GLOO`` or ``ACCEL``)."""
    purpose: str  # "tp", "dp", "self", "fwd", "bwd", "tie"
    ranks: tuple[int, ...]
    backend: str
    stage: Optional[int] = None  # tp/dp/self: the stage; fwd/bwd: the boundary after this pipeline chunk
    index: Optional[int] = None  # tp: the replica; dp: the tensor-parallel shard; tie: the tie's position

    @property
    def on_host(self) -> bool:
        """Its tensors live in host memory (gloo), else on the rank's accelerator."""
        return self.backend == GLOO


def vendor_of_rank(plan: Plan) -> dict[int, str]:
    """Every rank's vendor (a tensor-parallel group's ranks share their replica's device type)."""
    out = {}
    for st in plan.stages:
        for rep in st.replicas:
            vendor = plan.cluster.device_type(st.type_of(rep)).vendor
            for r in st.ranks_of(rep):
                out[r] = vendor
    return out


def spans_vendors(plan: Plan) -> bool:
    return len(set(vendor_of_rank(plan).values())) > 1


def world_backend(plan: Plan) -> str:
    """The world group's backend: gloo when the plan spans vendors, the accelerator's otherwise."""
    return GLOO if spans_vendors(plan) else ACCEL


@dataclass(frozen=True)
class WorldStart:
    """How every rank creates the world group: its backend and whether it binds the rank's device.

    Why it is decided here and created by hethub (before DeepSpeed's ``init_distributed``, which then finds it):
    binding a device (``device_id``, which DeepSpeed passes whenever the accelerator is CUDA) makes torch build
    every later NCCL group by splitting the world's communicator. A gloo world has none to split (torch raises a
    TypeError on the members of the first NCCL subgroup, the others wait), and in a bound NCCL world a gloo subgroup
    of some ranks makes the others run a split its members never join. So a bound world is NCCL/RCCL with no gloo
    subgroup but the all-ranks control channel; every other world is created unbound, and each NCCL/RCCL group
    then starts its own communicator from the store, the same way on every rank."""
    backend: str  # GLOO or ACCEL
    bind_device: bool
    why: str


def world_start(plan: Optional[Plan], on_cpu: bool) -> WorldStart:
    """The world of a run of ``plan`` (None: a run without one, e.g. a benchmark's ranks)."""
    if on_cpu:
        return WorldStart(GLOO, False, "CPU ranks: every group is gloo")
    if plan is not None and spans_vendors(plan):
        return WorldStart(GLOO, False, "the plan spans vendors: the world is gloo, NCCL/RCCL groups stay inside one")
    if plan is not None and any(s.on_host for s in group_specs(plan)):
        return WorldStart(ACCEL, False, "a host boundary inside one vendor: gloo subgroups of some ranks")
    return WorldStart(ACCEL, True, "one vendor, no gloo subgroup: groups split from the world's communicator")


def _backend(ranks: Sequence[int], vendors: dict[int, str], host: bool = False) -> str:
    return GLOO if host or len({vendors[r] for r in ranks}) > 1 else ACCEL


def boundary_groups(plan: Plan, after: int) -> tuple[int, int]:
    """The device groups on either side of the boundary after pipeline chunk ``after`` (with one chunk per group:
    stages ``after`` and ``after + 1``)."""
    return plan.pipeline[after].group, plan.pipeline[after + 1].group


def boundary_ranks(plan: Plan, after_stage: int) -> tuple[int, ...]:
    """The ranks that talk across the boundary after chunk ``after_stage``: the replicas' leads of both groups."""
    return tuple(sorted({rep.rank for s in boundary_groups(plan, after_stage) for rep in plan.stages[s].replicas}))


def layer_groups(plan: Plan) -> list[int]:
    """The device group holding each planner layer."""
    out = [0] * plan.pipeline[-1].last
    for c in plan.pipeline:
        out[c.first:c.last] = [c.group] * (c.last - c.first)
    return out


def group_specs(plan: Plan, tie_layers: Sequence[Sequence[int]] = ()) -> list[GroupSpec]:
    """Every group the runtime creates for ``plan``, in creation order (the same on every rank).

    ``tie_layers``: for each tied weight of the layer list, the planner layers holding it (a tie inside one stage
    needs no group)."""
    vendors = vendor_of_rank(plan)
    out: list[GroupSpec] = []
    for st in plan.stages:
        for j, rep in enumerate(st.replicas):
            if st.degree_of(rep) > 1:
                ranks = tuple(st.ranks_of(rep))
                out.append(GroupSpec("tp", ranks, _backend(ranks, vendors), st.index, j))
    for st in plan.stages:
        out += _reduce_groups(st, vendors)
    for r in range(plan.world_size):
        out.append(GroupSpec("self", (r,), ACCEL, plan.locate(r)[0]))
    for s in range(len(plan.pipeline) - 1):
        here, there = boundary_groups(plan, s)
        if here == there:  # zb-v's turn: a group hands each replica's rows to itself, no group needed
            continue
        boundary = plan.boundary(s)
        ranks = boundary_ranks(plan, s)
        backend = _backend(ranks, vendors, host=boundary is not None and boundary.transport == "host")
        out += [GroupSpec("fwd", ranks, backend, s), GroupSpec("bwd", ranks, backend, s)]
    layer_stage = layer_groups(plan)
    for i, layers in enumerate(tie_layers):
        stages = sorted({layer_stage[layer] for layer in layers})
        if len(stages) > 1:
            ranks = tuple(sorted(r for k in stages for rep in plan.stages[k].replicas
                                 for r in plan.stages[k].ranks_of(rep)))
            out.append(GroupSpec("tie", ranks, _backend(ranks, vendors), None, i))
    return out


def _reduce_groups(st, vendors: dict[int, str]) -> list[GroupSpec]:
    """The groups a stage's gradients are reduced over. Replicas of one degree: one group per shard index (the
    ranks holding the same shard). Replicas of different degrees hold shards that do not align (halves beside
    thirds): one group of every rank of the stage, which sums whole-size gradients (``hethub.runtime.mixed_tp``)."""
    if not st.uniform_tp:
        ranks = tuple(sorted(r for rep in st.replicas for r in st.ranks_of(rep)))
        return [GroupSpec("dp", ranks, _backend(ranks, vendors), st.index, 0)]
    return [GroupSpec("dp", tuple(st.ranks_of(rep)[k] for rep in st.replicas),
                      _backend([st.ranks_of(rep)[k] for rep in st.replicas], vendors), st.index, k)
            for k in range(st.tensor_parallel)]


def transfer_group(kind: str, stage: int) -> tuple[str, int]:
    """(direction, boundary) of the group a stage's transfer action uses: ``SA``/``RG`` cross the boundary after
    ``stage``, ``RA``/``SG`` the one before it; activations go forward, gradients backward."""
    direction = "fwd" if kind in ("SA", "RA") else "bwd"
    boundary = stage if kind in ("SA", "RG") else stage - 1
    return direction, boundary
