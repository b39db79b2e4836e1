"""Process groups from a plan: the ``mpu`` DeepSpeed's engine asks for, with stages of unequal width.

DeepSpeed's ``PipeDataParallelTopology`` is a dense (pipe x data) grid: every stage has the same
width, and the pipe group of a rank is "the ranks with my data-parallel index". With unequal widths
neither exists. Here a stage's data-parallel group is its replicas, there is no tensor/slice
parallelism (groups of one), and pipeline neighbours are found from sample-range overlaps
(``partitioner.schedule.overlaps``, the same function the simulator's schedule uses), not from a shared index.

Every rank creates every group in the same order (``torch.distributed.new_group`` is collective
over the world), so no rank waits on a group another rank never built.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from ..partitioner.records import Plan
from ..partitioner.schedule import overlaps
from ..models.ties import Tie, stages_of


class HeteroGrid:
    """DeepSpeed ``mpu`` for a heterogeneous plan. Build after ``torch.distributed`` is initialised."""

    def __init__(self, plan: Plan, rank: int, ties: Sequence[Tie] = ()):
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
        # neighbouring stages and shares what it receives with the group (hethub.tp, hethub.engine).
        self.tp = self.stage.tensor_parallel
        self.tp_ranks = self.stage.replicas[self.replica_id].group_ranks(self.tp)
        self.tp_rank = self.tp_ranks.index(rank)
        self.tp_lead = self.tp_ranks[0]
        self.schedule_rank = self.tp_lead  # whose schedule this rank runs
        self.tp_group = None
        for st in plan.stages:  # same order on every rank
            if st.tensor_parallel > 1:
                for rep in st.replicas:
                    ranks = rep.group_ranks(st.tensor_parallel)
                    group = dist.new_group(ranks=ranks)
                    if rank in ranks:
                        self.tp_group = group
        self.tp_mesh = None  # a DeviceMesh over tp_group, made by hethub.initialize when tp > 1
        # Data parallelism: the replicas holding the same parameters (with tensor parallelism, the same shard:
        # the k-th rank of every replica's group).
        dp_lists = [[rep.group_ranks(st.tensor_parallel)[k] for rep in st.replicas]
                    for st in plan.stages for k in range(st.tensor_parallel)]
        self._dp_group, self.dp_ranks = None, [rank]
        for ranks in dp_lists:
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                self._dp_group, self.dp_ranks = group, ranks
        self._self_group = None
        for r in range(self.world_size):
            group = dist.new_group(ranks=[r])
            if r == rank:
                self._self_group = group
        # The cross-vendor bridge: a gloo group over every rank, built by all ranks (same order) if used.
        self.host_group = None
        if any(b.transport == "host" for b in plan.boundaries):
            self.host_group = dist.new_group(ranks=list(range(self.world_size)), backend="gloo")
        # A stage whose replicas span vendors all-reduces gradients through the host bridge: a gloo group
        # over its ranks (built by all ranks, same order, for every such stage).
        self.stage_bridge_group = None
        for st in plan.stages:
            if len({plan.cluster.device_type(t).vendor for t in st.types}) > 1:
                for ranks in ([rep.group_ranks(st.tensor_parallel)[k] for rep in st.replicas]
                              for k in range(st.tensor_parallel)):
                    group = dist.new_group(ranks=ranks, backend="gloo")
                    if rank in ranks:
                        self.stage_bridge_group = group
        # Tied weights whose layers sit on different stages: one group over every replica of those stages.
        layer_stage = [k for k, st in enumerate(plan.stages) for _ in range(*st.layers)]
        self.tie_groups: list[tuple[Tie, object]] = []  # (tie, group) for the ties this rank holds
        for tie in ties:
            stages = stages_of(tie, layer_stage)
            if len(stages) < 2:
                continue  # one stage holds every place: autograd accumulates the one Parameter
            ranks = sorted(r for k in stages for rep in plan.stages[k].replicas
                           for r in rep.group_ranks(plan.stages[k].tensor_parallel))
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                self.tie_groups.append((tie, group))
        self.next_boundary = plan.boundary(self.stage_id)
        self.prev_boundary = plan.boundary(self.stage_id - 1) if self.stage_id > 0 else None
        # Rows [start, stop) of every micro-batch this replica owns.
        self.sample_start, self.sample_stop = self.stage.sample_ranges()[self.replica_id]
        # Transfer(peer rank, first row, stop row) for each overlapping replica of the neighbouring stages
        self.next_peers = overlaps(plan, self.stage_id, self.replica_id, "next")
        self.prev_peers = overlaps(plan, self.stage_id, self.replica_id, "prev")
        self.last_stage_root = self.stage_ranks[-1][0]

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
