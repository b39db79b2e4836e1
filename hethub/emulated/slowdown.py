"""Emulated heterogeneity: make a rank k times slower, so one CPU box can stand for a mixed cluster.

Never on by default. Enable per device type with ``"hetero": {"emulate_slowdown": {"SLOW": 3.0}}``
in ds_config, or ``HETHUB_EMULATE_SLOWDOWN="SLOW=3,FAST=1"`` in the environment; ``hethub profile
--emulate-slowdown K`` profiles under it. Each wrapped layer idles after its forward until the
forward has taken k x its *reference* forward time, and likewise after its backward. The reference
is the fastest time seen so far for that layer and row count: when several emulated ranks share a
few cores and one's real compute is slowed by another's, the emulated time stays k x the uncontended
time instead of growing k-fold with the contention (sleeping (k - 1) x the time just measured
would). Under schedule zb-h1 the wrappers see the input-gradient pass only; the engine idles the
weight pass (``W``) the same way. Where the layer's input carries no gradient (token ids into an embedding), the backward
time cannot be observed and twice the reference forward time stands for it. Under activation
checkpointing (a plan's recompute stage) the layer's forward runs again inside its backward, and a
recomputed layer takes k x (forward + forward + backward) either way: torch stops the recompute at
the last saved tensor by default, before the wrapper idles, so its real time falls in the measured
backward; a whole recomputed forward (early stop off) idles itself and is kept out of that
measurement (else it would count k x k).

Pinned (``hethub.emulated.pinned``), a rank's wrapped layers queue their pinned times on one ``DeviceClock``, as a
GPU's kernels queue on its stream, and wait for it only where a pass ends (its chunk's last layer forward, first
backward): the host work between a pass's layers overlaps the emulated device's time, as kernel launches overlap
a GPU's kernels, instead of adding to it.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import torch
from torch import nn

from ..dsconfig import MAX_SLOWDOWN
from ..partitioner.errors import InputError


class DeviceClock:
    """An emulated device's queue: work issued at ``issued_s`` starts once the device is free and takes its pinned
    seconds, and never ends before its real compute did (``done_s``). ``sync`` waits until the queue is empty, what
    a pass's end does (its output is sent, or the next pass reads it)."""

    def __init__(self):
        self.free_s = 0.0

    def queue(self, issued_s: float, pinned_s: float, done_s: float) -> None:
        self.free_s = max(max(issued_s, self.free_s) + pinned_s, done_s)

    def sync(self) -> None:
        time.sleep(max(0.0, self.free_s - time.perf_counter()))


def _pinned_pass(state: dict, phase: str, issued_s: float) -> bool:
    """Queue a pinned phase on its layer's device clock (and wait for the clock where the pass ends there); False
    where the phase is not pinned (self-calibrated instead)."""
    target = state["ref"].get("pinned", {}).get(phase)
    if target is None:
        return False
    clock = state["clock"]
    clock.queue(issued_s, target, time.perf_counter())
    if state["sync"][phase]:
        clock.sync()
    return True


class _Start(torch.autograd.Function):
    """Identity on the layer's output; its backward runs when the output's gradient arrives."""

    @staticmethod
    def forward(ctx, y, state):
        ctx.state = state
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        ctx.state["bwd_start"] = time.perf_counter()
        # a forward of this layer from now until _End's backward is its recompute (activation checkpointing)
        ctx.state["ref"]["in_backward"] = ctx.state["input_tracked"]
        if not ctx.state["input_tracked"] and not _pinned_pass(ctx.state, "bwd", ctx.state["bwd_start"]):
            time.sleep((ctx.state["factor"] - 1.0) * 2 * ctx.state["ref"]["fwd"])
        return g, None


class _End(torch.autograd.Function):
    """Identity on the layer's input; its backward runs once the layer's backward has finished. A copy where the
    layer writes into its input (``nn.ReLU(inplace=True)``): autograd forbids writing into a custom Function's
    view of its input (``SlowDown`` finds out on the first call)."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        return x.clone() if state["copy_input"] else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        st, ref = ctx.state, ctx.state["ref"]
        recompute_s = ref.pop("recompute_s", 0.0)  # already idled to k x as a forward
        ref["in_backward"] = False
        # a pinned backward's time holds its recomputed forward, whichever way it ran
        start = st.get("bwd_start", time.perf_counter())
        if not _pinned_pass(st, "bwd", start):
            idle_to(st["factor"], ref, "bwd", time.perf_counter() - start - recompute_s)
        return g, None


def idle_to(factor: float, ref: dict, phase: str, took_s: float) -> None:
    """Sleep until this phase has taken ``factor`` x its fastest time seen (the reference), updated first.
    The first call only sets the reference: it carries one-time costs (allocations, a tensor-parallel
    layer's sharding set-up: seconds), which k x would turn into minutes of idling. A phase pinned in
    ``ref["pinned"]`` (``hethub.emulated.pinned``: the executor's weight pass, which ends its pass) sleeps until it
    has taken that many seconds instead."""
    target = ref.get("pinned", {}).get(phase)
    if target is not None:
        time.sleep(max(0.0, target - took_s))
        return
    if phase not in ref:
        ref[phase] = took_s
        return
    ref[phase] = min(ref[phase], took_s)
    time.sleep(max(0.0, factor * ref[phase] - took_s))


class SlowDown(nn.Module):
    """Runs ``module`` and then idles, so that forward and backward take ``factor`` x as long; or, ``pinned``
    ((rows, {"fwd": s, "bwd": s})), as long as that says for inputs of that many rows, queued on ``clock`` (the
    rank's device, shared by its layers) and waited for after the forward and the backward where ``sync`` says
    (this layer ends its chunk's forward, begins it). Alone, a pinned layer has a clock of its own and waits after
    both, so each pass of it takes its pin."""

    def __init__(self, module: nn.Module, factor: float, pinned: Optional[tuple[int, dict[str, float]]] = None,
                 clock: Optional[DeviceClock] = None, sync: tuple[bool, bool] = (True, True)):
        super().__init__()
        if factor < 1:
            raise ValueError(f"emulate_slowdown: factor must be >= 1, got {factor}")
        self.module = module
        self.factor = float(factor)
        self._ref: dict[tuple, dict[str, float]] = {}  # rows -> fastest forward/backward seconds seen
        if pinned is not None:
            self._ref[(pinned[0],)] = {"pinned": dict(pinned[1])}
        self._clock = clock if clock is not None else DeviceClock()
        self._sync = {"fwd": sync[0], "bwd": sync[1]}
        self._writes_input: Optional[bool] = None  # whether the layer writes into its input (probed on a copy, once)

    def forward(self, x):
        tracked = torch.is_tensor(x) and x.is_floating_point() and torch.is_grad_enabled()
        rows = tuple(x.shape[:1]) if torch.is_tensor(x) else ()
        state = {"factor": self.factor, "input_tracked": tracked, "ref": self._ref.setdefault(rows, {}),
                 "clock": self._clock, "sync": self._sync, "copy_input": self._writes_input is not False}
        recomputing = state["ref"].get("in_backward", False)
        if tracked:
            if not x.requires_grad:
                x = x.detach().requires_grad_()
            x = _End.apply(x, state)
        version = x._version if tracked else 0
        t0 = time.perf_counter()
        y = self.module(x)
        if tracked and self._writes_input is None:
            self._writes_input = x._version != version
        # a pinned recompute is inside its backward's pin: it queues nothing
        if not (recomputing and "pinned" in state["ref"]) and not _pinned_pass(state, "fwd", t0):
            idle_to(self.factor, state["ref"], "fwd", time.perf_counter() - t0)
        if recomputing:
            state["ref"]["recompute_s"] = state["ref"].get("recompute_s", 0.0) + time.perf_counter() - t0
        if torch.is_tensor(y) and y.requires_grad:
            y = _Start.apply(y, state)
        return y


def parse_factors(text: str, what: str = "HETHUB_EMULATE_SLOWDOWN") -> dict[str, float]:
    """``"SLOW=3,FAST=1.5"`` -> {"SLOW": 3.0, "FAST": 1.5}: the one parser of TYPE=FACTOR lists. A bad item is
    an InputError naming ``what`` (one line, exit 2, wherever it is read)."""
    out = {}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, k = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            factor = float(k)
        except ValueError:
            raise InputError(what, f"{item[:60]!r} is not TYPE=FACTOR") from None
        if not 1.0 <= factor <= MAX_SLOWDOWN:
            raise InputError(what, f"{name.strip()[:60]}: factor must be in [1, {MAX_SLOWDOWN:g}], "
                                   f"got {k.strip()[:20]}")
        out[name.strip()] = factor
    return out


def slowdown_for(device_type: str, config_map: Optional[dict] = None) -> float:
    """The emulated slowdown factor for a device type: ds_config's map, else HETHUB_EMULATE_SLOWDOWN, else 1."""
    if config_map and device_type in config_map:
        return float(config_map[device_type])
    return parse_factors(os.environ.get("HETHUB_EMULATE_SLOWDOWN", "")).get(device_type, 1.0)
