"""The layers of one stage: ``HeteroPipelineModule``, what DeepSpeed's engine sees as its model.

Its layers are taken from the plan's layer ranges (one per chunk the rank's group holds, under interleaved or
zb-v schedules several), not from DeepSpeed's partition methods, and it knows which planner layer each of its
modules is (``indexed_layers``), which gradients (ties) and checkpoints (per-layer files) both ask for. One module
holds every chunk, so DeepSpeed's optimizer, the all-reduce buckets and ZeRO-1 see one parameter list; a forward
runs one chunk (``forward(x, chunk=j)``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from deepspeed.runtime.pipe.module import PipelineModule
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..emulated.slowdown import SlowDown
from . import ds_seams


class HeteroPipelineModule(PipelineModule):
    """The layers of one stage. ``PipelineModule.__init__`` is not called (it builds a dense
    ``PipelineParallelGrid`` and its own partition); ``ds_seams.PIPELINE_MODULE_ATTRS`` are the attributes
    DeepSpeed's engine reads from it instead."""

    def __init__(self, layers: Sequence[Any], loss_fn: Optional[Callable], grid):
        nn.Module.__init__(self)
        self._layer_index = [idx for a, b in grid.stage.chunk_ranges for idx in range(a, b)]  # planner layer of each
        self.forward_funcs = [_built(layers[idx], idx) for idx in self._layer_index]
        self.local_layers = nn.ModuleList([m for m in self.forward_funcs if isinstance(m, nn.Module)])
        self._chunk_slices, at = [], 0  # the forward_funcs of each chunk, in the group's order
        for a, b in grid.stage.chunk_ranges:
            self._chunk_slices.append(slice(at, at + b - a))
            at += b - a
        self.loss_fn = loss_fn
        self._grid = grid
        self._recompute = grid.stage.recompute
        self._chunk_params: Optional[list[list[nn.Parameter]]] = None  # per chunk (chunk_parameters)
        for name, value in ds_seams.pipeline_module_attrs(grid).items():
            setattr(self, name, value)

    def forward(self, x, chunk: int = 0):
        """Chunk ``chunk`` (0 with one chunk per group) of this group's layers on ``x``."""
        # A plan's recompute stage keeps only each layer's input and runs the layer's forward again in its
        # backward (what the cost model charges: memory ``act_bytes_recompute``, one more forward). Non-
        # reentrant checkpointing: it keeps autograd's graph, so zb-h1 can still split the backward.
        recompute = self._recompute and torch.is_grad_enabled()
        for f in self.forward_funcs[self._chunk_slices[chunk]]:
            x = checkpoint(f, x, use_reentrant=False) if recompute else f(x)
        return x

    def indexed_layers(self) -> list[tuple[int, nn.Module]]:
        """(planner layer index, the user's module) for this stage, unwrapping emulation wrappers."""
        out = []
        for idx, f in zip(self._layer_index, self.forward_funcs):
            base = f.module if isinstance(f, SlowDown) else f
            if isinstance(base, nn.Module):
                out.append((idx, base))
        return out

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The trainable parameters chunk ``chunk``'s layers use (a weight tied across two of the group's chunks is
        in both), each once. Found once, at the first call (the executor asks at every split B and W): the
        parameters are final by then, placed and split before the module was built."""
        if self._chunk_params is None:
            self._chunk_params = []
            for s in self._chunk_slices:
                seen: dict[int, nn.Parameter] = {}
                for f in self.forward_funcs[s]:
                    if isinstance(f, nn.Module):
                        seen.update((id(p), p) for p in f.parameters() if p.requires_grad)
                self._chunk_params.append(list(seen.values()))
        return self._chunk_params[chunk]

    def mpu(self):
        return self._grid

    def topology(self):
        return None

    def get_tied_weights_and_groups(self):
        return []

    def get_additional_losses(self):
        return None


def _built(spec: Any, idx: int):
    """A layer of the user's list as a callable: a module as is, a ``LayerSpec`` built, a function wrapped."""
    if isinstance(spec, nn.Module):
        return spec
    if hasattr(spec, "build"):  # deepspeed.pipe.LayerSpec
        return spec.build()
    if callable(spec):
        return _Lambda(spec)
    raise TypeError(f"layers[{idx}]: expected an nn.Module, a LayerSpec or a callable, got {type(spec)}")


class _Lambda(nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)
