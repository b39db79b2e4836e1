"""One rank's action list, executed in order: the only place that knows what each action kind does.

The list comes from ``partitioner.schedule.build_schedule`` (or a hand-edited, checked schedule file): the same
list ``hethub simulate`` replays, so what is predicted is what runs. The executor owns an iteration's tensors
(inputs, labels, outputs, losses, pending weight passes) and hands boundary traffic to the ``Transport``,
reductions to the ``Gradients`` and the optimizer step to the callback it was given.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..emulated.slowdown import idle_to
from ..partitioner.errors import print_error
from ..partitioner.schedule import Action
from . import split_backward
from .errors import Guard
from .gradients import Gradients
from .transport import Transport


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _wants_grad(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.requires_grad


class Executor:
    """Runs action lists for one rank. ``next_batch()`` gives the next micro-batch ``(inputs, labels)``;
    ``step()`` is the optimizer step (the DeepSpeed adapter's)."""

    def __init__(self, grid, module, transport: Transport, gradients: Gradients, guard: Guard, *,
                 device: torch.device, micro_batch_size: int, next_batch: Callable[[], Any],
                 step: Callable[[], None], autocast_dtype: Optional[torch.dtype] = None, emulate_slowdown: float = 1.0):
        self.grid, self.module, self.transport, self.gradients, self.guard = grid, module, transport, gradients, guard
        self.device, self.micro_batch_size = device, micro_batch_size
        self._next_batch, self._step = next_batch, step
        self.autocast_dtype, self.emulate_slowdown = autocast_dtype, emulate_slowdown
        self.first = grid.stage_id == 0
        self.last = grid.stage_id == grid.pipe_parallel_size - 1
        self.rows = grid.sample_stop - grid.sample_start
        self.executed: list[str] = []  # the actions of the last run, as text, in order
        self.executed_s: list[tuple[float, float, float]] = []  # (start, end, seconds waiting for data) of each
        self.total_loss: Optional[torch.Tensor] = None
        self.loss_scale = 1.0  # fp16: the loss scaler's scale, set by the engine before each iteration
        self._emulated_w_ref: dict[str, float] = {}  # the fastest weight pass seen
        self._linears: Optional[split_backward.LinearCalls] = None  # hooks recording Linear calls, at first zb-h1
        self._handlers = {"L": self._load, "F": self._forward, "B": self._backward, "W": self._weight,
                          "SA": self._send_activations, "RA": self._recv_activations,
                          "SG": self._send_grads, "RG": self._recv_grads,
                          "AR": lambda a: self.gradients.reduce(), "OPT": lambda a: self._step()}
        self._reset()

    def _reset(self) -> None:
        self._inputs: dict[int, Any] = {}  # micro-batch -> this stage's input (loaded or received)
        self._labels: dict[int, Any] = {}
        self._outputs: dict[int, Any] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._wgrad: dict[int, split_backward.Pending] = {}  # micro-batch -> where its weight pass resumes (zb-h1)
        self._linear_calls: dict[int, list] = {}  # micro-batch -> its forward's plain Linear calls (zb-h1)
        self.transport.reset()

    def run(self, actions: Sequence[Action], loss_denominator: int) -> None:
        """Execute one iteration's actions in order; every send has landed when this returns."""
        self._reset()
        self.total_loss, self._loss_denominator = None, loss_denominator
        self.executed, self.executed_s = [], []
        self._split_mbs = {a.mb for a in actions if a.kind == "W"}  # their B computes input gradients only
        self._weights = [p for p in self.module.parameters() if p.requires_grad] if self._split_mbs else []
        if self._split_mbs and self._linears is None:
            self._linears = split_backward.LinearCalls(self.module)
        last_grad = self._last_gradient_action(actions)
        if last_grad is not None:
            self.gradients.start_iteration()
        with self._precision(None):
            for i, a in enumerate(actions):
                self._run_action(a, armed=i == last_grad)
        self.guard.watch((), "the iteration's last sends")
        self.transport.wait_sends()

    def _precision(self, kind: Optional[str]):
        """Autocast for the whole iteration (``kind`` None), then per action: on for forwards only.

        One autocast region spans the iteration so that its cast cache lives as long: each weight is cast to
        the low-precision dtype once per iteration, not once per micro-batch forward (the graphs of all
        in-flight micro-batches then share one copy instead of holding one each). Backward, weight passes and
        transfers run with autocast off inside it (nested, so the cache stays); recompute re-enters the
        forward's autocast and finds the same copies. The cache is dropped before the optimizer step changes
        the weights it copied."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        if kind == "OPT":
            torch.clear_autocast_cache()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=kind in (None, "F"))

    def _run_action(self, a: Action, armed: bool) -> None:
        self.guard.watch([t.peer for t in a.transfers], str(a))
        t0, self.transport.waited_s = time.perf_counter(), 0.0
        self.gradients.arm(armed)  # the all-reduce's buckets start as this action completes them
        with self._precision(a.kind):
            self._handlers[a.kind](a)  # a user's layer or loss raising here shows its own traceback
        self.gradients.arm(False)
        self.transport.release_sends()
        self.executed.append(str(a))
        self.executed_s.append((t0, time.perf_counter(), self.transport.waited_s))

    def _last_gradient_action(self, actions: Sequence[Action]) -> Optional[int]:
        """Index of the iteration's last action that accumulates weight gradients (a B whose weight pass is not
        split off, or a W), where the iteration all-reduces them; else None."""
        if not any(a.kind == "AR" for a in actions):
            return None
        grads = [i for i, a in enumerate(actions) if a.kind == "W" or (a.kind == "B" and a.mb not in self._split_mbs)]
        return grads[-1] if grads else None

    # ------------------------------------------------------------------ data
    def _load(self, a: Action) -> None:
        batch = self._next_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError("hethub: data_iter must yield (inputs, labels) per micro-batch")
        inputs, labels = batch
        if self.first:
            self._inputs[a.mb] = self._rows(inputs, "inputs")
        if self.last:
            self._labels[a.mb] = self._rows(labels, "labels")

    def _rows(self, x, what: str):
        """This replica's rows of a whole micro-batch (a tensor or a tuple of tensors), on the device."""
        lo, hi = self.grid.sample_start, self.grid.sample_stop
        for t in as_tuple(x):
            if not torch.is_tensor(t):
                raise ValueError(f"hethub: {what} must be a tensor, got {type(t).__name__}")
            if t.shape[0] != self.micro_batch_size:
                raise ValueError(f"hethub: {what} has {t.shape[0]} rows; the plan's micro_batch_size is "
                                 f"{self.micro_batch_size}")
        mine = tuple(t[lo:hi].to(self.device) for t in as_tuple(x))
        return mine if isinstance(x, tuple) else mine[0]

    # ------------------------------------------------------------------ compute
    def _forward(self, a: Action) -> None:
        if not self.first:
            received = self.transport.take("A", a.mb)
            for t, (_, _, req) in zip(received, self.transport.recv_meta):
                t.requires_grad_(req and torch.is_grad_enabled())
            self._inputs[a.mb] = tuple(received) if len(received) > 1 else received[0]
        inputs = self._inputs[a.mb]
        if isinstance(inputs, tuple):
            inputs = tuple(t.clone() if not t.is_floating_point() else t for t in inputs)
        capture = (self._linears.capturing() if a.mb in self._split_mbs and torch.is_grad_enabled()
                   else contextlib.nullcontext())
        with capture as calls:  # under the iteration's autocast (_precision)
            outputs = self.module(inputs)
            if calls is not None:
                self._linear_calls[a.mb] = calls
            if self.last:
                labels = self._labels.pop(a.mb)
                loss = self.module.loss_fn(outputs, labels) if self.module.loss_fn is not None else outputs
        if self.first or not torch.is_grad_enabled():
            self._inputs.pop(a.mb)  # nothing to send upstream: no need to keep the input
        if self.last:
            self._keep_loss(a.mb, loss)
        else:
            self._outputs[a.mb] = outputs

    def _keep_loss(self, mb: int, loss) -> None:
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError("hethub: loss_fn must return a scalar tensor (mean over the given samples)")
        # Mean over this replica's samples -> its share of the mean over the whole batch.
        loss = loss * (self.rows / self._loss_denominator)
        detached = loss.detach()
        self.total_loss = detached.clone() if self.total_loss is None else self.total_loss + detached
        if torch.is_grad_enabled():
            self._losses[mb] = loss

    def _backward(self, a: Action) -> None:
        if self.last:  # the scaled loss: every gradient upstream, boundaries included, carries the scale
            loss = self._losses.pop(a.mb)
            roots, grads = [loss * self.loss_scale if self.loss_scale != 1.0 else loss], None
        else:
            roots = [o for o in as_tuple(self._outputs.pop(a.mb)) if _wants_grad(o)]
            grads = self.transport.take("G", a.mb, like=roots)
        if a.mb not in self._split_mbs:
            torch.autograd.backward(tensors=roots, grad_tensors=grads)
            return
        # zb-h1: the input gradients now (SG sends them next), the weights' at this micro-batch's W
        inputs = [t for t in as_tuple(self._inputs[a.mb]) if _wants_grad(t)]
        try:
            self._wgrad[a.mb] = split_backward.backward_input(roots, grads, inputs, self._weights, self.grid.stage_id,
                                                              self._linear_calls.pop(a.mb, ()))
        except split_backward.SplitBackwardError as exc:  # the model, not a bug: one line (peers see it lost)
            print_error(f"rank {self.grid.global_rank}: {exc}")
            os._exit(2)  # not SystemExit: gloo's threads may still hold the process

    def _weight(self, a: Action) -> None:
        t0 = time.perf_counter()
        split_backward.backward_weight(self._weights, self._wgrad.pop(a.mb), on_ready=self.gradients.ready)
        if self.emulate_slowdown != 1.0:  # the layers' wrappers slow the input pass; the weight pass is slowed here
            idle_to(self.emulate_slowdown, self._emulated_w_ref, "w", time.perf_counter() - t0)

    # ------------------------------------------------------------------ transfers
    def _send_activations(self, a: Action) -> None:
        self.transport.send_activations(as_tuple(self._outputs[a.mb]), a.transfers)

    def _recv_activations(self, a: Action) -> None:
        self.transport.recv_activations(a.mb, a.transfers)

    def _send_grads(self, a: Action) -> None:
        inputs = [t for t in as_tuple(self._inputs.pop(a.mb)) if _wants_grad(t)]
        if not self.transport.is_lead:
            return  # the group's lead sends the (replicated) input gradients once
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        self.transport.send_grads(grads, a.transfers)

    def _recv_grads(self, a: Action) -> None:
        outputs = [o for o in as_tuple(self._outputs[a.mb]) if _wants_grad(o)]
        self.transport.recv_grads(a.mb, outputs, a.transfers)
