"""Process groups from a plan: the ``mpu`` DeepSpeed's engine asks for, with stages of unequal width.

DeepSpeed's ``PipeDataParallelTopology`` is a dense (pipe x data) grid: every stage has the same
width, and the pipe group of a rank is "the ranks with my data-parallel index". With unequal widths
neither exists. Here a stage's data-parallel group is its replicas (per tensor-parallel shard), DeepSpeed's
model/slice-parallel groups are groups of one (tensor parallelism is hethub's own, per replica), and pipeline neighbours are found from sample-range overlaps
(``partitioner.schedule.overlaps``, the same function the simulator's schedule uses), not from a shared index.

Every rank creates every group in the same order (``torch.distributed.new_group`` is collective
over the world), so no rank waits on a group another rank never built.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..partitioner.records import Plan
from ..partitioner.schedule import overlaps
from ..models.ties import Tie, stages_of


class HeteroGrid:
    """DeepSpeed ``mpu`` for a heterogeneous plan. Build after ``torch.distributed`` is initialised: the
    constructor creates every process group (collective over the world, same order on every rank).
    ``device_name`` is the accelerator's ("cpu", "cuda"): a tensor-parallel group's DeviceMesh lives on it."""

    def __init__(self, plan: Plan, rank: int, ties: Sequence[Tie] = (), device_name: str = "cpu"):
        self.plan = plan
        self.global_rank = rank
        self.world_size = plan.world_size
        self.stage_id, self.replica_id = plan.locate(rank)
        self.stage = plan.stages[self.stage_id]
        self.device_type = self.stage.type_of(self.stage.replicas[self.replica_id])  # this rank's accelerator
        self.stage_ranks = [[r.rank for r in s.replicas] for s in plan.stages]  # replicas' leads
        self.pipe_parallel_size = plan.num_stages
        self.data_parallel_size = self.stage.width
        self.data_parallel_id = self.replica_id
        self.model_parallel_size = 1
        self.slice_parallel_size = 1
        # Tensor parallelism: this replica is a group of tp ranks; the lead (its first) talks to the
        # neighbouring stages and shares what it receives with the group (hethub.runtime.transport).
        self.tp = self.stage.tensor_parallel
        self.tp_ranks = self.stage.replicas[self.replica_id].group_ranks(self.tp)
        self.tp_rank = self.tp_ranks.index(rank)
        self.tp_lead = self.tp_ranks[0]
        self.schedule_rank = self.tp_lead  # whose schedule this rank runs
        self.tp_group = self._mine([rep.group_ranks(st.tensor_parallel) for st in plan.stages
                                    if st.tensor_parallel > 1 for rep in st.replicas])
        self.tp_mesh = DeviceMesh.from_group(self.tp_group, device_name) if self.tp > 1 else None
        # Data parallelism: the replicas holding the same parameters (with tensor parallelism, the same shard:
        # the k-th rank of every replica's group).
        self.dp_ranks = next(r for r in self._shard_groups(plan.stages) if rank in r)
        self._dp_group = self._mine(self._shard_groups(plan.stages))
        self._self_group = self._mine([[r] for r in range(self.world_size)])
        self._build_bridges(plan)
        self.tie_groups = self._build_tie_groups(plan, ties)
        self.next_boundary = plan.boundary(self.stage_id)
        self.prev_boundary = plan.boundary(self.stage_id - 1) if self.stage_id > 0 else None
        # Rows [start, stop) of every micro-batch this replica owns.
        self.sample_start, self.sample_stop = self.stage.sample_ranges()[self.replica_id]
        # Transfer(peer rank, first row, stop row) for each overlapping replica of the neighbouring stages
        self.next_peers = overlaps(plan, self.stage_id, self.replica_id, "next")
        self.prev_peers = overlaps(plan, self.stage_id, self.replica_id, "prev")
        self.last_stage_root = self.stage_ranks[-1][0]

    def _mine(self, rank_lists, backend: Optional[str] = None):
        """Create a group for each rank list (every rank, same order); return the one holding this rank."""
        found = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=list(ranks), backend=backend)
            if self.global_rank in ranks:
                found = group
        return found

    @staticmethod
    def _shard_groups(stages) -> list[list[int]]:
        """Per stage and tensor-parallel shard k: the k-th rank of every replica (they hold the same tensors)."""
        return [[rep.group_ranks(st.tensor_parallel)[k] for rep in st.replicas]
                for st in stages for k in range(st.tensor_parallel)]

    def _build_bridges(self, plan: Plan) -> None:
        """The cross-vendor bridge: a gloo group over every rank where a boundary crosses vendors, and per stage
        whose replicas span vendors a gloo group per shard for its gradient all-reduce."""
        self.host_group = None
        if any(b.transport == "host" for b in plan.boundaries):
            self.host_group = dist.new_group(ranks=list(range(self.world_size)), backend="gloo")
        mixed = [st for st in plan.stages if len({plan.cluster.device_type(t).vendor for t in st.types}) > 1]
        self.stage_bridge_group = self._mine(self._shard_groups(mixed), backend="gloo")

    def _build_tie_groups(self, plan: Plan, ties: Sequence[Tie]) -> list[tuple[Tie, object]]:
        """(tie, group) for the ties this rank holds whose layers sit on several stages: one group over every
        rank of those stages. A tie inside one stage needs none (autograd accumulates the one Parameter)."""
        layer_stage = [k for k, st in enumerate(plan.stages) for _ in range(*st.layers)]
        out = []
        for tie in ties:
            stages = stages_of(tie, layer_stage)
            if len(stages) < 2:
                continue
            ranks = sorted(r for k in stages for rep in plan.stages[k].replicas
                           for r in rep.group_ranks(plan.stages[k].tensor_parallel))
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                out.append((tie, group))
        return out

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
