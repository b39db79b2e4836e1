"""What autograd holds for backward: the activation memory a forward leaves behind, measured.

``hethub profile`` measures it per layer and the cost model prices a rank's in-flight micro-batches with it
(``partitioner.costmodel.with_measured_activations``); ``benchmarks/chunked.py`` measures it per rank over whole
iterations, against the schedule's predicted peak. Both count the same way: every tensor saved for backward, each
storage once however many saves share it (a layer's output saved again as the next layer's input), parameters not
at all (a Linear saves its weight, which the state already holds whatever the micro-batch count), nor autocast's
low-precision copies of them (one per iteration, shared by every micro-batch).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


class _Held:
    """One saved tensor; its storage counts as held until autograd drops the last save of it."""
    __slots__ = ("t", "meter", "key")

    def __init__(self, t: torch.Tensor, meter: "ActivationMeter", key: int):
        self.t, self.meter, self.key = t, meter, key

    def __del__(self):
        self.meter._drop(self.key)


class ActivationMeter:
    """While active (``with meter:``), counts the bytes of storages autograd saves for backward: ``held`` now,
    ``peak`` the most at once since ``reset``. ``params``: tensors never counted."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        params = list(params)
        self._skip = {_storage_key(p) for p in params}
        self._param_ids = {id(p) for p in params}
        self._saves: dict[int, int] = {}  # storage -> saves alive
        self._bytes: dict[int, int] = {}
        self.held = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def reset(self) -> None:
        self.peak = self.held

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key in self._skip or key == 0 or self._copies_a_parameter(t):
            return t
        self._hold(key, t)
        # detached: a saved graph output kept with its grad_fn would own the node that owns this save, a cycle
        # autograd never frees once the graph is retained (the split backward's input pass retains it)
        return _Held(t.detach(), self, key)

    def _hold(self, key: int, t: torch.Tensor) -> None:
        if key not in self._saves:
            self._saves[key], self._bytes[key] = 0, t.untyped_storage().nbytes()
            self.held += self._bytes[key]
            self.peak = max(self.peak, self.held)
        self._saves[key] += 1

    def _copies_a_parameter(self, t: torch.Tensor, depth: int = 3) -> bool:
        """Whether ``t`` is a parameter cast or viewed (autocast's copy, its transpose): a chain of one-input
        autograd nodes up to the parameter's gradient accumulator."""
        fn = t.grad_fn
        for _ in range(depth):
            if fn is None or len(fn.next_functions) != 1:
                return False
            fn = fn.next_functions[0][0]
            if fn is not None and id(getattr(fn, "variable", None)) in self._param_ids:
                return True
        return False

    def _drop(self, key: int) -> None:
        self._saves[key] -= 1
        if not self._saves[key]:
            del self._saves[key]
            self.held -= self._bytes.pop(key)

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)


_ACTIVE: list[ActivationMeter] = []  # the meters inside their ``with``, innermost last


def pin(tensors: Iterable[Optional[torch.Tensor]]) -> tuple:
    """Count ``tensors`` as held (each storage once, with the saves) by the innermost active meter until
    ``unpin`` of the returned token. Why: after a split backward's input pass (zb-h1, zb-v) the weight pass waits
    with tensors autograd no longer holds (a plain Linear's X and dY, the gradients recorded where a weight's path
    joins), memory the micro-batch still takes; counting autograd's saves alone missed them."""
    if not _ACTIVE:
        return ()
    meter, keys = _ACTIVE[-1], []
    for t in tensors:
        key = _storage_key(t) if t is not None else 0
        if key and key not in meter._skip:
            meter._hold(key, t)
            keys.append(key)
    return (meter, keys)


def unpin(token: tuple) -> None:
    if token:
        meter, keys = token
        for key in keys:
            meter._drop(key)


def _unpack(h):
    return h.t if isinstance(h, _Held) else h


def _storage_key(t: torch.Tensor) -> int:
    """A tensor's storage (0 for a tensor without one: a DTensor's local shard is keyed instead)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: never counted
        return 0
