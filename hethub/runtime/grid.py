"""Process groups from a plan: the ``mpu`` DeepSpeed's engine asks for, with stages of unequal width.

DeepSpeed's ``PipeDataParallelTopology`` is a dense (pipe x data) grid: every stage has the same
width, and the pipe group of a rank is "the ranks with my data-parallel index". With unequal widths
neither exists. Here a stage's data-parallel group is its replicas (per tensor-parallel shard), DeepSpeed's
model/slice-parallel groups are groups of one (tensor parallelism is hethub's own, per replica), and pipeline
neighbours are found from sample-range overlaps (``partitioner.schedule.overlaps``, the same function the
simulator's schedule uses), not from a shared index.

Which groups exist, with which ranks and backend, is data (``partitioner.groups.group_specs``): one group per
(boundary, direction), gloo wherever ranks span vendors or a boundary goes through the host bridge. Every rank
creates every group in the same order (``torch.distributed.new_group`` is collective over the world), so no rank
waits on a group another rank never built.
"""
from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..partitioner.groups import GroupSpec, group_specs
from ..partitioner.records import Plan
from ..models.ties import Tie


class HeteroGrid:
    """DeepSpeed ``mpu`` for a heterogeneous plan. Build after ``torch.distributed`` is initialised: the
    constructor creates every group of ``partitioner.groups.group_specs`` (collective over the world, the same
    order on every rank). ``device_name`` is the accelerator's ("cpu", "cuda"): a tensor-parallel group's
    DeviceMesh lives on it, and groups that are not gloo use its backend. ``timeout_s``: every group's."""

    def __init__(self, plan: Plan, rank: int, ties: Sequence[Tie] = (), device_name: str = "cpu",
                 timeout_s: float = 300.0):
        self.plan = plan
        self.global_rank = rank
        self.world_size = plan.world_size
        self.stage_id, self.replica_id = plan.locate(rank)
        self.stage = plan.stages[self.stage_id]
        # The pipeline chunks this rank's group holds (``Plan.pipeline`` positions; with one chunk per group, the
        # stage's own index): actions, boundaries and transfers are keyed by them.
        self.positions: tuple[int, ...] = plan.chunks_of_group[self.stage_id]
        self.num_positions = len(plan.pipeline)
        self.holds_first = 0 in self.positions  # loads the inputs
        self.holds_last = self.num_positions - 1 in self.positions  # loads the labels, computes the loss
        self.device_type = self.stage.type_of(self.stage.replicas[self.replica_id])  # this rank's accelerator
        self.stage_ranks = [[r.rank for r in s.replicas] for s in plan.stages]  # replicas' leads
        self.pipe_parallel_size = plan.num_stages
        self.data_parallel_size = self.stage.width
        self.data_parallel_id = self.replica_id
        self.model_parallel_size = 1
        self.slice_parallel_size = 1
        # Tensor parallelism: this replica is a group of tp ranks; the lead (its first) talks to the
        # neighbouring stages and shares what it receives with the group (hethub.runtime.transport).
        replica = self.stage.replicas[self.replica_id]
        self.tp = self.stage.degree_of(replica)  # this replica's (replicas of one stage may differ: mixed_tp)
        self.tp_ranks = self.stage.ranks_of(replica)
        # Replicas of different degrees hold shards that do not align: gradients are reduced whole over every rank
        # of the stage (hethub.runtime.mixed_tp), not per shard.
        self.mixed_tp = not self.stage.uniform_tp
        self.tp_rank = self.tp_ranks.index(rank)
        self.tp_lead = self.tp_ranks[0]
        self.schedule_rank = self.tp_lead  # whose schedule this rank runs
        self._create_groups(plan, ties, device_name, datetime.timedelta(seconds=timeout_s))
        self.tp_mesh = DeviceMesh.from_group(self.tp_group, device_name) if self.tp > 1 else None
        # Rows [start, stop) of every micro-batch this replica owns (the same in each of its chunks).
        self.sample_start, self.sample_stop = self.stage.sample_ranges()[self.replica_id]
        self.last_stage_root = self.stage_ranks[-1][0]

    def _create_groups(self, plan: Plan, ties: Sequence[Tie], device_name: str, timeout: datetime.timedelta) -> None:
        """Every group of the plan, in the specs' order (each with the run's timeout: a lost peer ends a wait on
        any of them); this rank keeps the ones it is in."""
        accel = _accelerator_backend(device_name)
        specs = group_specs(plan, [[i for i, _ in tie.places] for tie in ties])
        self.specs: list[GroupSpec] = specs  # what was created, in order (tests read it)
        self._spec_of: dict[object, GroupSpec] = {}
        self._gloo: set = set()  # this rank's groups that are gloo here (every group on CPU)
        mine: dict[tuple, object] = {}
        for spec in specs:
            group = dist.new_group(ranks=list(spec.ranks), backend="gloo" if spec.on_host else accel, timeout=timeout)
            if self.global_rank in spec.ranks:
                mine[(spec.purpose, spec.stage, spec.index)] = group
                self._spec_of[group] = spec
                if spec.on_host or accel == "gloo":
                    self._gloo.add(group)
        self.tp_group = mine.get(("tp", self.stage_id, self.replica_id))
        dp = next(s for s in specs if s.purpose == "dp" and s.stage == self.stage_id and self.global_rank in s.ranks)
        self.dp_ranks = list(dp.ranks)  # the ranks holding this rank's shard (mixed_tp: every rank of the stage)
        self._dp_group = mine[("dp", self.stage_id, dp.index)]
        self.dp_bridged = self._spec_of[self._dp_group].on_host  # the stage spans vendors: gloo on any machine
        self._self_group = mine[("self", self.stage_id, None)]
        # per (direction, boundary after chunk b): the groups of the boundaries this rank's chunks talk across
        self.p2p = {(d, b): mine[(d, b, None)] for d in ("fwd", "bwd") for k in self.positions for b in (k - 1, k)
                    if (d, b, None) in mine}
        self.tie_groups: list[tuple[Tie, object]] = [(ties[spec.index], mine[("tie", None, spec.index)])
                                                     for spec in specs if spec.purpose == "tie"
                                                     and ("tie", None, spec.index) in mine]

    def my_groups(self) -> list:
        """Every group this rank belongs to (the world's own excepted)."""
        return list(self._spec_of)

    def local_chunk(self, position: int) -> int:
        """Which of this group's chunks (0, 1, ...) pipeline chunk ``position`` is."""
        return self.positions.index(position)

    def on_host(self, group) -> bool:
        """Whether a group is gloo here, so its tensors live in host memory (else on this rank's accelerator)."""
        return group in self._gloo

    # --- the mpu interface DeepSpeed's engine uses
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.replica_id

    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_rank(self) -> int:
        return self.replica_id

    def get_model_parallel_group(self):
        return self._self_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_group(self):
        raise NotImplementedError("hethub: stages of unequal width have no pipe-parallel group; the engine "
                                  "talks to its boundary peers instead")

    def stage_to_global(self, stage_id: int, **_kw) -> int:
        """First replica of a stage (a stage has several ranks; callers that need all use stage_ranks)."""
        return self.stage_ranks[stage_id][0]


def _accelerator_backend(device_name: str) -> Optional[str]:
    """The backend of groups that are not gloo: NCCL/RCCL on GPUs (named, since the world may be gloo), gloo on
    CPU."""
    return "gloo" if device_name == "cpu" else "nccl"
