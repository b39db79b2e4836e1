"""Turn a stage layout (layer ranges, device type, per-replica samples) into a concrete Plan.

Why separate: the planner decides *how many* devices of which type serve each stage; placing
them on hosts/slots (a stage's replicas on one node where they fit, so its all-reduce and the
pipeline's p2p use intra-node links) and numbering ranks is the same job for the ILP, the
baselines, the demo and the tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import InfeasibleError
from .records import Cluster, ModelConfig, Plan, Predicted, SolverInfo


@dataclass(frozen=True)
class StageLayout:
    layers: tuple[int, int]
    device_type: str
    samples: tuple[int, ...]  # per replica, of each micro-batch
    recompute: bool = False
    tensor_parallel: int = 1
    zero1: bool = False  # the stage shards its optimizer state over its replicas
    replica_types: tuple[str, ...] = ()  # per replica, for a stage that mixes types (empty: all device_type)
    # per replica, for a stage whose replicas differ in tensor-parallel degree (empty: all tensor_parallel, which is
    # then the largest)
    replica_tp: tuple[int, ...] = ()

    def type_of(self, replica: int) -> str:
        return self.replica_types[replica] if self.replica_types else self.device_type

    def tp_of(self, replica: int) -> int:
        return self.replica_tp[replica] if self.replica_tp else self.tensor_parallel


def place(cluster: Cluster, layouts: Sequence[StageLayout]) -> list[list[tuple[str, int]]]:
    """(host, slot) for every replica of every stage.

    Greedy: each stage takes slots on the node of its type with the most free slots first (so a stage
    stays on one node when it can); stages are served in order, so neighbours tend to share nodes —
    except that stages with larger tensor-parallel groups go first: a group needs consecutive slots of one
    node, and placing 8s before 4s before 2s before 1s leaves no unusable remainders on nodes whose size
    the degrees divide.
    """
    free = {i: list(slots) for i, (_, slots) in enumerate(cluster.entry_slots())}  # per entry (host, type)
    out: list[list[tuple[str, int]]] = [[] for _ in layouts]
    for i in sorted(range(len(layouts)), key=lambda k: -layouts[k].tensor_parallel):
        lay = layouts[i]
        slots = {}
        kinds = dict.fromkeys((lay.type_of(r), lay.tp_of(r)) for r in range(len(lay.samples)))
        for t, tp in sorted(kinds, key=lambda k: -k[1]):  # a mixed stage: type by type, larger groups first
            mine = [r for r in range(len(lay.samples)) if (lay.type_of(r), lay.tp_of(r)) == (t, tp)]
            slots.update(zip(mine, _take_slots(cluster, free, i, t, len(mine), tp)))
        out[i] = [slots[r] for r in range(len(lay.samples))]
    return out


def _take_slots(cluster: Cluster, free: dict[int, list[int]], i: int, device_type: str, need: int, tp: int
                ) -> list[tuple[str, int]]:
    """(host, first slot) for ``need`` replicas (groups of ``tp``) of stage i on nodes of ``device_type`` (a node:
    one entry of the cluster, a host's devices of one type)."""
    entries = cluster.entry_slots()
    nodes = [k for k, (n, _) in enumerate(entries) if n.device_type == device_type]
    slots: list[tuple[str, int]] = []
    while len(slots) < need:
        # Prefer a node that holds all the remaining replicas; else the emptiest node.
        rest = need - len(slots)
        fitting = [k for k in nodes if len(free[k]) >= rest * tp]
        pool = sorted(fitting, key=lambda k: len(free[k])) or sorted(nodes, key=lambda k: -len(free[k]))
        if not pool or len(free[pool[0]]) < tp:
            have = sum(len(free[k]) for k in nodes)
            if have >= rest * tp:
                raise InfeasibleError(f"stages[{i}]", f"its tensor-parallel groups need {tp} free {device_type} "
                                                      f"slots on one node; the {have} left are spread over nodes")
            raise InfeasibleError(f"stages[{i}]", f"needs {need * tp} {device_type} devices, only {have} left")
        k = pool[0]
        # all of this node's free groups the stage still needs (one at a time spread a 32-replica stage over 24
        # nodes: their NICs then carried several stages' boundaries and the all-reduce crossed 24 hosts)
        for _ in range(min(rest, len(free[k]) // tp)):
            slots.append((entries[k][0].host, free[k][0]))
            del free[k][:tp]
    return slots


def build_plan(model: ModelConfig, cluster: Cluster, layouts: Sequence[StageLayout], micro_batch_size: int,
               num_micro_batches: int, predicted: Optional[Predicted] = None,
               solver: Optional[SolverInfo] = None, schedule: str = "1f1b", dtype: Optional[str] = None) -> Plan:
    """A validated Plan.

    Ranks are numbered host by host (hosts in the order the pipeline first uses them), slots
    ascending within a host: DeepSpeed's launcher numbers ranks exactly so from a hostfile in that
    order and an ``--include`` list, so ``hethub launch`` can put every rank where the plan says.
    """
    placement = place(cluster, layouts)
    host_order: list[str] = []
    for slots in placement:
        for host, _ in slots:
            if host not in host_order:
                host_order.append(host)
    used = sorted((host_order.index(h), slot + t) for lay, slots in zip(layouts, placement)
                  for r, (h, slot) in enumerate(slots) for t in range(lay.tp_of(r)))
    rank_of = {(host_order[h], slot): r for r, (h, slot) in enumerate(used)}
    stages = []
    for i, (lay, slots) in enumerate(zip(layouts, placement)):
        reps = []
        for r in sorted(range(len(slots)), key=lambda r: rank_of[slots[r]]):
            (host, slot), n = slots[r], lay.samples[r]
            if lay.tp_of(r) == 1 and (lay.tensor_parallel == 1 or lay.replica_tp):
                rep = {"rank": rank_of[(host, slot)], "host": host, "slot": slot, "samples": int(n)}
            else:  # a tensor-parallel group: consecutive slots of one host
                group = [slot + k for k in range(lay.tp_of(r))]
                rep = {"ranks": [rank_of[(host, g)] for g in group], "host": host, "slots": group, "samples": int(n)}
            if lay.type_of(r) != lay.device_type:
                rep["device_type"] = lay.type_of(r)
            reps.append(rep)
        stages.append({"index": i, "layers": list(lay.layers), "device_type": lay.device_type,
                       "tensor_parallel": lay.tensor_parallel, "recompute": lay.recompute, "zero1": lay.zero1,
                       "replicas": reps})
    boundaries = [{"after_stage": i, "transport": "host"} for i in range(len(layouts) - 1)
                  if cluster.device_type(layouts[i].device_type).vendor
                  != cluster.device_type(layouts[i + 1].device_type).vendor]
    data = {"model": model, "cluster": cluster, "global_batch_size": micro_batch_size * num_micro_batches,
            "micro_batch_size": micro_batch_size, "num_micro_batches": num_micro_batches, "stages": stages,
            "boundaries": boundaries, "schedule": schedule, "dtype": dtype}
    if predicted is not None:
        data["predicted"] = predicted
    if solver is not None:
        data["solver"] = solver
    return Plan.model_validate(data)


def even_split(micro_batch_size: int, width: int) -> tuple[int, ...]:
    """Equal split of a micro-batch over ``width`` replicas (the first ones take the remainder)."""
    base, extra = divmod(micro_batch_size, width)
    return tuple(base + (1 if k < extra else 0) for k in range(width))
