"""Emulated ranks pinned to profiles: each slowed layer takes the time the cost model gives it, not k x its fastest.

Why: a rank emulated by ``slowdown`` idles to k x the fastest real time it has seen of each layer. When up to nine
such ranks share two cores, that fastest time is itself 10-25% above what ``hethub profile`` measured alone (the
cores' caches and the other ranks' bursts), and k multiplies it: the emulated device runs slower than its profile
says, and a prediction from the profile looks 10-20% off for reasons no GPU has. Pinned, the emulated device *is*
its profile (``HETHUB_EMULATE_PROFILES=DIR``, the profiles ``hethub profile --emulate-slowdown`` wrote): every
wrapped layer's forward and backward, and every weight pass, end when the cost model built from those profiles
says they would (``costmodel.pass_times_s``, layer by layer, what ``hethub simulate`` replays), or when the real
compute ends if that is later. A rank's layers queue those times on one device clock, as a GPU's kernels queue on
its stream, so the host's work between the layers of a pass overlaps them (``slowdown.DeviceClock``). What a run
then measures beyond the prediction is the schedule, the transfers and
the runtime's own overhead: what a pipeline prediction has to get right. Test and benchmark helper only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..partitioner.costmodel import cost_model_for, pass_times_s
from ..partitioner.errors import InputError
from ..partitioner.records import Plan, Profile, load_profiles
from .slowdown import DeviceClock, SlowDown

PROFILES_ENV = "HETHUB_EMULATE_PROFILES"


def load_pin_profiles() -> Optional[list[Profile]]:
    """The profiles ``HETHUB_EMULATE_PROFILES`` names (a directory of ``hethub profile`` outputs), or None."""
    folder = os.environ.get(PROFILES_ENV, "")
    if not folder:
        return None
    try:
        return load_profiles(folder)
    except InputError as exc:
        raise InputError(PROFILES_ENV, exc.message if exc.field == "--profiles" else str(exc)) from None


def check_pin_profiles(plan: Plan, profiles: list[Profile], emulated_types: set[str]) -> None:
    """Every emulated device type has a profile (its analytic times would not be an emulated CPU's), and the
    profiles price the plan's model (the cost model refuses another model's): one line, before any collective."""
    for t in sorted(emulated_types - {p.device_type for p in profiles}):
        raise InputError(PROFILES_ENV, f"no profile for device type {t!r}: give one per emulated type")
    try:
        cost_model_for(plan, profiles)
    except InputError as exc:
        raise InputError(PROFILES_ENV, str(exc)) from None


@dataclass(frozen=True)
class Pins:
    """Seconds this rank's emulated passes take. ``layer_s[i]``: {"fwd", "bwd"} of planner layer i at this
    replica's rows (a split chunk's "bwd" is its input pass, a recomputing stage's holds the forward run again);
    ``weight_s[position]``: a split chunk's weight pass."""
    rows: int
    layer_s: dict[int, dict[str, float]]
    weight_s: dict[int, float]


def pins_for(plan: Plan, profiles: list[Profile], stage: int, device_type: str, rows: int,
             split_positions: set[int], tensor_parallel: Optional[int] = None) -> Pins:
    """The pins of one replica of group ``stage`` (``device_type``, ``rows`` samples per micro-batch) whose chunks
    at ``split_positions`` split their backward (their action list has weight passes), priced by the plan's
    cost model (cluster, model, dtype) with these profiles. ``tensor_parallel``: the replica's degree (default: the
    stage's)."""
    cm = cost_model_for(plan, profiles)
    st = plan.stages[stage]
    layer_s, weight_s = {}, {}
    for position in plan.chunks_of_group[stage]:
        chunk, split = plan.pipeline[position], position in split_positions
        for i in range(chunk.first, chunk.last):
            # a recomputing stage's "bwd" holds the forward it runs again (``SlowDown`` times it inside)
            fwd, bwd, wgt = pass_times_s(cm, device_type, i, i + 1, rows, st.recompute,
                                         tensor_parallel or st.tensor_parallel, split)
            layer_s[i] = {"fwd": fwd, "bwd": bwd}
            weight_s[position] = weight_s.get(position, 0.0) + wgt
    return Pins(rows, layer_s, {k: s for k, s in weight_s.items() if k in split_positions})


def slowed_chunk(layers: list, first: int, factor: float, pins: Optional[Pins], clock: DeviceClock) -> list:
    """One chunk's layers (planner layers ``first``, ``first + 1``, ...) wrapped in the emulated slowdown. Pinned,
    they queue their pins on the rank's ``clock`` and wait for it where the chunk's passes end: after the last
    layer's forward and the first layer's backward (the weight pass waits in the executor)."""
    last = first + len(layers) - 1
    return [SlowDown(layer, factor, (pins.rows, pins.layer_s[i]), clock, sync=(i == last, i == first))
            if pins else SlowDown(layer, factor) for i, layer in enumerate(layers, start=first)]
