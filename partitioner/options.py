"""``PlannerOptions``: what a search may choose, validated where it is made.

Why a module of its own: the CLI reads its defaults from here (one home for each default), and the CLI must not
import the solvers to print ``--help``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .errors import InputError
from .records import MAX_BATCH, SCHEDULES

AUTO = "auto"  # the schedule: the fastest of every schedule that fits memory (``schedule_search``)
SOLVERS = ("highs", "cbc", "brute-force")
# How the objective prices the network: "overlap" (the runtime's: transfers posted non-blocking overlap compute,
# the all-reduce hides behind the last backward) or "no-overlap" (Sailor's simulator: every boundary transfer on
# the compute's path, the whole all-reduce after the last backward). A plan planned for both is robust to which
# one a fleet turns out to follow.
NETWORKS = ("overlap", "no-overlap")
MAX_TIME_LIMIT_S = 86400.0  # a day: past it a time limit is a typo


@dataclass(frozen=True)
class PlannerOptions:
    """What a search may choose. The CLI's flags default to these fields (``hethub.cli.parser``); a bad value is
    one line naming the field (``InputError("PlannerOptions.<field>", ...)``), where the options are made."""
    solver: str = "highs"  # highs | cbc | brute-force
    time_limit_s: float = 60.0  # for the whole search, split over micro-batch sizes
    micro_batch_sizes: Optional[tuple[int, ...]] = None  # default: divisors of the global batch <= max
    max_micro_batch_size: int = 64
    allow_recompute: bool = True
    # Chunk the blocks into at most this many units (chain MILP). None: every layer is a cut point; models of
    # identical blocks longer than SHAPES_MIN_LAYERS go to the shape MILP, others are chunked at DEFAULT_MAX_UNITS.
    max_units: Optional[int] = None
    device_types: Optional[tuple[str, ...]] = None  # restrict to these types (fastest-only, homogeneous sums)
    # Every stage the same width w, each replica micro_batch / w samples: what Megatron-core's
    # parallel_state can express (stages may still differ in device type and layer count); no tensor parallelism.
    equal_widths: bool = False
    # Tensor-parallel degrees a stage may use: 1, 2, 4, 8 up to this (only those that fit in one node of the
    # type and divide heads, KV heads and the FFN size). 1 turns tensor parallelism off.
    max_tensor_parallel: int = 8
    # Stages may mix two device types of one vendor (``mixed_splits``: speed-proportional integer splits).
    mixed_types: bool = True
    # The pipeline schedule plans are written for (``schedule.SCHEDULES``), or ``auto`` (the fastest replay of
    # every schedule that fits memory; ``hethub plan``'s default): its memory (the last stage holds two
    # micro-batches under zb-h1) bounds the candidates, the replay that picks the plan runs it. The API's default
    # is 1F1B, the one schedule every runtime (Megatron's export included) runs as planned.
    schedule: str = "1f1b"
    # A stage may shard its optimizer state over its replicas (ZeRO-1) where that lets it hold more micro-batches
    # in flight; --zero1 (the cost model's) shards every stage instead.
    zero1_stages: bool = True
    network: str = "overlap"  # NETWORKS: the network model the search and the choice among plans price

    def __post_init__(self):
        """Checked where made (the CLI, the elastic re-plan, a user's script): one line naming the option."""
        _one_of("solver", self.solver, SOLVERS)
        _one_of("schedule", self.schedule, (*SCHEDULES, AUTO))
        _one_of("network", self.network, NETWORKS)
        _number_in("time_limit_s", self.time_limit_s, 0.0, MAX_TIME_LIMIT_S, low_open=True)
        _number_in("max_micro_batch_size", self.max_micro_batch_size, 1, MAX_BATCH, integer=True)
        _number_in("max_tensor_parallel", self.max_tensor_parallel, 1, 1024, integer=True)
        if self.max_units is not None:
            _number_in("max_units", self.max_units, 1, 100_000, integer=True)
        for b in self.micro_batch_sizes or ():
            _number_in("micro_batch_sizes", b, 1, MAX_BATCH, integer=True)
        if self.device_types is not None and (isinstance(self.device_types, str) or not all(
                isinstance(t, str) for t in self.device_types)):
            raise InputError("PlannerOptions.device_types", f"expected a tuple of device type names, got "
                                                            f"{str(self.device_types)[:60]}")
        for name in ("allow_recompute", "equal_widths", "mixed_types", "zero1_stages"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"PlannerOptions.{name}", f"expected true or false, got {getattr(self, name)!r}"[:120])


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise InputError(f"PlannerOptions.{name}", f"expected one of {', '.join(allowed)}, got {str(value)[:60]!r}")


def _number_in(name: str, value, low, high, integer: bool = False, low_open: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        raise InputError(f"PlannerOptions.{name}", f"must be {'an integer' if integer else 'a number'} "
                                                   f"{'>' if low_open else '>='} {low:g} and <= {high:g}, "
                                                   f"got {str(value)[:40]}")
