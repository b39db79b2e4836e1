"""Capture mode: a training script run by ``hethub profile --script`` stops at its engine's first step, handing over
its layers, its loss and its first micro-batch to be measured.

Why run the user's script rather than ask for a description: the layers a DeepSpeed script builds (its
``PipelineModule``'s specs, its loss, what its data loader yields) are the model, and nothing else says what they
cost. Under ``HETHUB_PROFILE_CAPTURE=1`` (set by the profiler, which runs the script in its own process):

- ``deepspeed.init_distributed`` starts nothing (one process measures);
- ``PipelineModule(...)`` keeps its specs without making a topology (as under a plan);
- ``deepspeed.initialize`` / ``hethub.initialize`` build every layer and return a ``CaptureEngine`` whose first
  ``train_batch`` / ``eval_batch`` (with the script's iterator, or its ``training_data``) raises ``Captured``.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from ..models.ties import resolve_tied_specs
from .frontdoor import training_loader

CAPTURE_ENV = "HETHUB_PROFILE_CAPTURE"
MICRO_BATCH_ENV = "HETHUB_PROFILE_MICRO_BATCH"


def capturing() -> bool:
    return os.environ.get(CAPTURE_ENV) == "1"


class Captured(BaseException):
    """The script reached its first step: what it would train (a BaseException: the script's own ``except
    Exception`` must not swallow it)."""

    def __init__(self, layers: list, loss_fn: Optional[Callable], batch: Any):
        super().__init__("captured")
        self.layers, self.loss_fn, self.batch = layers, loss_fn, batch


class CaptureEngine:
    """Stands in for the engine until the first step. Anything else a script asks of it before that step is one
    line naming it (the profile measures a script up to its first ``train_batch``)."""

    def __init__(self, layers: list, loss_fn: Optional[Callable], training_data: Any, collate_fn: Optional[Callable]):
        self._layers, self._loss_fn = layers, loss_fn
        self._data, self._collate = training_data, collate_fn

    def train_batch(self, data_iter=None):
        if data_iter is None:
            if self._data is None:
                raise AttributeError("train_batch: no data iterator and no training_data given to initialize")
            micro_batch = int(os.environ.get(MICRO_BATCH_ENV, "1"))
            data_iter = iter(training_loader(self._data, micro_batch, self._collate))
        raise Captured(self._layers, self._loss_fn, next(data_iter))

    eval_batch = train_batch

    def __getattr__(self, name: str):
        raise AttributeError(f"engine.{name}: hethub profile --script measures a script up to its first "
                             f"train_batch; the script used the engine before it")


def capture_engine(layers: list, loss_fn: Optional[Callable], training_data: Any, collate_fn: Optional[Callable]):
    """``initialize``'s return value in capture mode: every layer built (ties shared), no loader (the first step
    reads ``training_data`` itself)."""
    engine = CaptureEngine(resolve_tied_specs(layers, range(len(layers))), loss_fn, training_data, collate_fn)
    return engine, None, None, None
