"""Every pipeline schedule hethub plans, simulates, runs and exports, as one frozen record each: the one home of
what a schedule *is*.

Why a registry: the planner (memory in flight, weight passes held at the end, the schedule the MILP plans for),
the simulator and the closed form (chunked or not, which stages split their backward, the round-robin
remainder), the runtime's action lists (placement of chunks on groups) and the exports (what Megatron runs it
as) all ask the same questions of a schedule. Asked here, a new schedule is one record plus the executor's
handling of any new action; nowhere else compares schedule names. (The action lists themselves are built by
``schedule`` and ``chunked`` from these facts.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ONE, ROUND_ROBIN, V_SHAPE = "one", "round-robin", "v"  # chunk placements


@dataclass(frozen=True)
class ScheduleKind:
    """``chunked``: device groups hold several chunks (``Stage.chunks``); ``placement``: which group holds chunk k
    of p groups; ``fixed_chunks``: chunks per group it requires (None: any); ``split_backward``: backward runs as
    B (input gradients, sent at once) and W (weight gradients) later (every chunk but the pipeline's first, whose
    input has no gradient); ``orders_by_time``: its list scheduler orders passes by their times (a plan carries
    ``chunk_pass_ms``); ``milp``: the one-chunk schedule the MILP plans
    its groups for (its groups are then re-cut into chunks); ``megatron``: how Megatron runs it (None: it cannot,
    ``export megatron`` refuses)."""
    name: str
    description: str
    chunked: bool = False
    placement: str = ONE
    fixed_chunks: Optional[int] = None
    split_backward: bool = False
    orders_by_time: bool = False
    milp: str = "1f1b"
    megatron: Optional[str] = "1F1B"

    def chunk_group(self, num_groups: int, position: int) -> int:
        """The device group that holds pipeline chunk ``position`` (the contract's placement): round-robin
        (interleaved-1f1b), V-shaped (zb-v: k for k < p, then 2p-1-k), else chunk k is stage k."""
        p = num_groups
        if self.placement == ROUND_ROBIN:
            return position % p
        if self.placement == V_SHAPE:
            return position if position < p else 2 * p - 1 - position
        return position

    def splits(self, position: int) -> bool:
        """Whether pipeline chunk ``position`` (a one-chunk schedule's stage) splits its backward: the first's
        input has no gradient to send ahead."""
        return self.split_backward and position > 0

    def peak_in_flight(self, num_stages: int, stage: int, num_micro_batches: int) -> int:
        """Micro-batches whose activations one-chunk stage ``stage`` holds at its peak: 1F1B's S - s (capped at
        M); a split schedule's last stage holds two at its end (its last B runs before the W of the one before)."""
        S, M = num_stages, num_micro_batches
        if self.split_backward and not self.chunked and stage == S - 1 and S > 1:
            return min(2, M)
        return min(S - stage, M)

    def trailing_weight_passes(self, num_stages: int, stage: int, num_micro_batches: int) -> int:
        """W actions a one-chunk stage runs after its last B (before its all-reduce): none without a split or on
        stage 0; one, and two on the last stage (its last B comes before its second-to-last W)."""
        if not self.splits(stage) or self.chunked:
            return 0
        return min(2, num_micro_batches) if stage == num_stages - 1 else 1

    @property
    def in_rounds(self) -> bool:
        """Micro-batches run in rounds of p (round-robin chunks, Megatron's interleaved order): a shortened replay
        keeps M's remainder mod p."""
        return self.placement == ROUND_ROBIN


KINDS = {k.name: k for k in (
    ScheduleKind("1f1b", "PipeDream-flush: each backward in one pass", milp="1f1b"),
    ScheduleKind("zb-h1", "1F1B whose stages after the first split each backward into B (input gradients, sent "
                          "upstream at once) and W (weight gradients) right after it; the last stage runs its last "
                          "B before its second-to-last W (Qi et al. 2023, ZB-H1's memory: one micro-batch more on "
                          "the last stage only)",
                 split_backward=True, milp="zb-h1", megatron="1F1B (Megatron runs this as 1F1B)"),
    ScheduleKind("interleaved-1f1b", "each device group holds v chunks, chunk k on group k mod p (Narayanan et al. "
                                     "2021): the fill shrinks about v-fold for v times the boundary traffic; any "
                                     "micro-batch count",
                 chunked=True, placement=ROUND_ROBIN, megatron="interleaved 1F1B (virtual pipeline)"),
    ScheduleKind("zb-v", "each device group holds two chunks in a V (chunk k on group k, then on 2p-1-k), backward "
                         "split into input and weight gradients, weight passes filling the bubbles (Qi et al. 2024) "
                         "at 1F1B's memory",
                 chunked=True, placement=V_SHAPE, fixed_chunks=2, split_backward=True, orders_by_time=True,
                 megatron=None),
)}


BASE = "1f1b"  # what every plan can run: the fallback where another schedule's memory leaves no plan
AUTO_MILP = "zb-h1"  # what the MILP plans ``auto``'s groups for (``schedule_search.search_schedule`` says why)


def kind(name: str) -> ScheduleKind:
    """The record of schedule ``name`` (validated plans and options name a known one)."""
    return KINDS[name]
