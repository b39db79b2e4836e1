"""A rank's emulated device type, as one object: what wraps its layers and what slows its weight passes.

Why one object: an emulated device (``slowdown``: k x the fastest real time; ``pinned``: the profiles' times) is
a property of the rank's hardware, not of start-up or of the schedule's executor. Start-up asks ``for_rank`` once;
the stage's layers are wrapped by ``wrap`` (their forward and backward idle inside the wrappers), and the one pass
no layer wrapper sees, a split backward's weight pass (``W``, run by the executor over the chunk's weights), runs
inside ``weight_pass``. A rank with no emulation gets None and nothing of this runs. Test and benchmark helper.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

from ..partitioner.records import Plan, Profile
from ..partitioner.schedule import build_schedule
from .pinned import Pins, pins_for, slowed_chunk
from .slowdown import DeviceClock, idle_to, slowdown_for


class EmulatedDevice:
    """A device type ``factor`` x slower than this CPU, or pinned to ``pins`` (``hethub.emulated.pinned``)."""

    def __init__(self, factor: float, pins: Optional[Pins] = None):
        self.factor, self.pins = factor, pins
        self.clock = DeviceClock()  # the rank's one device, which all its chunks' pinned layers queue on
        # the fastest weight pass seen, per chunk; or its seconds pinned
        self._weight_ref: dict = {"pinned": {f"w{k}": s for k, s in (pins.weight_s if pins else {}).items()}}

    def wrap(self, layers: list, first: int) -> list:
        """One chunk's layers (planner layers ``first``, ``first + 1``, ...), wrapped."""
        return slowed_chunk(layers, first, self.factor, self.pins, self.clock)

    @contextmanager
    def weight_pass(self, position: int) -> Iterator[None]:
        """The weight pass of the chunk at pipeline ``position``, slowed as the device would run it."""
        t0 = time.perf_counter()
        yield
        idle_to(self.factor, self._weight_ref, f"w{position}", time.perf_counter() - t0)


def for_rank(plan: Plan, grid, factors: Optional[dict], pin_profiles: Optional[list[Profile]],
             actions: Optional[list] = None) -> Optional[EmulatedDevice]:
    """The emulated device of this rank (``grid``: its place in ``plan``), or None where its type runs as is.
    ``factors``: the ds_config's ``emulate_slowdown`` (else ``HETHUB_EMULATE_SLOWDOWN``); ``pin_profiles``: the
    profiles ``HETHUB_EMULATE_PROFILES`` pins it to; ``actions``: the rank's action list (its chunks with weight
    passes split their backward; the plan's schedule where None)."""
    factor = slowdown_for(grid.device_type, factors)
    if factor == 1.0:
        return None
    if pin_profiles is None:
        return EmulatedDevice(factor)
    actions = actions if actions is not None else build_schedule(plan)[grid.schedule_rank]
    split = {a.chunk if a.chunk is not None else grid.stage_id for a in actions if a.kind == "W"}
    return EmulatedDevice(factor, pins_for(plan, pin_profiles, grid.stage_id, grid.device_type,
                                           grid.sample_stop - grid.sample_start, split, grid.tp))
