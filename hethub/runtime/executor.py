"""One rank's action list, executed in order: the only place that knows what each action kind does.

The list comes from ``partitioner.schedule.build_schedule`` (or a hand-edited, checked schedule file): the same
list ``hethub simulate`` replays, so what is predicted is what runs. The executor owns an iteration's tensors
(inputs, labels, outputs, losses, pending weight passes) and hands boundary traffic to the ``Transport``,
reductions to the ``Gradients`` and the optimizer step to the callback it was given.

Under a chunked schedule (interleaved-1f1b, zb-v) a rank's group holds several chunks: every tensor an iteration
keeps is keyed by (micro-batch, chunk), a pass runs its chunk's layers only, and the gradients of a chunk's weights
are final after that chunk's last backward or weight pass (where its all-reduce buckets may start).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch

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
                 step: Callable[[], None], autocast_dtype: Optional[torch.dtype] = None, emulated=None):
        self.grid, self.module, self.transport, self.gradients, self.guard = grid, module, transport, gradients, guard
        self.device, self.micro_batch_size = device, micro_batch_size
        self._next_batch, self._step = next_batch, step
        self.autocast_dtype = autocast_dtype
        # an emulated device type (hethub.emulated.device): its layers are wrapped already; it slows weight passes
        self.emulated = emulated
        self.last_position = grid.num_positions - 1
        self.rows = grid.sample_stop - grid.sample_start
        self.executed: list[str] = []  # the actions of the last run, as text, in order
        self.executed_s: list[tuple[float, float, float]] = []  # (start, end, seconds waiting for data) of each
        self.total_loss: Optional[torch.Tensor] = None
        self.loss_scale = 1.0  # fp16: the loss scaler's scale, set by the engine before each iteration
        self._linears: Optional[split_backward.LinearCalls] = None  # hooks recording Linear calls, at first zb-h1
        self._walks: dict[int, split_backward.WalkCache] = {}  # per chunk: its backward's split, by graph structure
        self._writes_inputs: dict[int, bool] = {}  # chunk -> whether its forward writes into its inputs (probed once)
        self._probe: dict[int, list] = {}  # chunk -> (clone, its version before the forward) while probing
        self._loads: list[int] = []  # the micro-batches this iteration loads, in order
        self._ahead: dict[int, tuple] = {}  # micro-batch -> its rows, copied ahead (GPU)
        self._handlers = {"L": self._load, "F": self._forward, "B": self._backward, "W": self._weight,
                          "SA": self._send_activations, "RA": self._recv_activations,
                          "SG": self._send_grads, "RG": self._recv_grads,
                          "AR": lambda a: self.gradients.reduce(), "OPT": lambda a: self._step()}
        self._reset()

    def _reset(self) -> None:
        # keyed by (micro-batch, pipeline chunk); labels by micro-batch
        self._inputs: dict[tuple[int, int], Any] = {}  # a chunk's input (loaded or received)
        self._labels: dict[int, Any] = {}
        self._outputs: dict[tuple[int, int], Any] = {}
        self._losses: dict[tuple[int, int], torch.Tensor] = {}
        self._wgrad: dict[tuple[int, int], split_backward.Pending] = {}  # where a weight pass resumes (zb-h1, zb-v)
        self._linear_calls: dict[tuple[int, int], list] = {}  # a forward's plain Linear calls (split backward)
        self.transport.reset()

    def _at(self, a: Action) -> int:
        """The pipeline chunk an action works at (its rank's stage with one chunk per group)."""
        return a.chunk if a.chunk is not None else self.grid.stage_id

    def run(self, actions: Sequence[Action], loss_denominator: int) -> None:
        """Execute one iteration's actions in order; every send has landed when this returns."""
        self._reset()
        self._loads, self._ahead = sorted(a.mb for a in actions if a.kind == "L"), {}
        self.total_loss, self._loss_denominator = None, loss_denominator
        self.executed, self.executed_s = [], []
        self._split = {(a.mb, self._at(a)) for a in actions if a.kind == "W"}  # their B: input gradients only
        if self._split and self._linears is None:
            self._linears = split_backward.LinearCalls(self.module)
        finals = self._final_gradients(actions)
        if finals:
            self.gradients.start_iteration()
        with self._precision(None):
            for i, a in enumerate(actions):
                self._run_action(a, armed=finals.get(i, frozenset()))
        self.guard.watch((), "the iteration's last sends")
        self.transport.wait_sends()
        self.guard.idle()

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

    def _run_action(self, a: Action, armed: frozenset) -> None:
        self.guard.watch([t.peer for t in a.transfers], str(a))
        t0, self.transport.waited_s = time.perf_counter(), 0.0
        self.gradients.arm(armed)  # the all-reduce's buckets start as this action completes them
        with self._precision(a.kind):
            self._handlers[a.kind](a)  # a user's layer or loss raising here shows its own traceback
        self.gradients.arm(frozenset())
        self.transport.release_sends()
        self.transport.progress()
        self.executed.append(str(a))
        self.executed_s.append((t0, time.perf_counter(), self.transport.waited_s))

    def _final_gradients(self, actions: Sequence[Action]) -> dict[int, frozenset]:
        """action index -> ids of the parameters whose gradients that action finishes: each chunk's weights are
        final after its last gradient-accumulating action (a B whose weight pass is not split off, or a W), a
        weight two chunks share after the later one's. Empty where the iteration all-reduces nothing."""
        if not any(a.kind == "AR" for a in actions):
            return {}
        last: dict[int, int] = {}  # chunk -> index of its last gradient action
        for i, a in enumerate(actions):
            if a.kind == "W" or (a.kind == "B" and (a.mb, self._at(a)) not in self._split):
                last[self._at(a)] = i
        final: dict[int, int] = {}  # parameter id -> the action finishing it
        for k, i in last.items():
            for p in self.module.chunk_parameters(self.grid.local_chunk(k)):
                final[id(p)] = max(final.get(id(p), -1), i)
        out: dict[int, set] = {}
        for pid, i in final.items():
            out.setdefault(i, set()).add(pid)
        return {i: frozenset(ids) for i, ids in out.items()}

    # ------------------------------------------------------------------ data
    def _load(self, a: Action) -> None:
        """This rank's rows of the next micro-batch. On a GPU they were copied ahead: each load reads the
        micro-batch after it (when this iteration loads one more) and issues its host -> device copies from
        pinned memory without waiting, so the copy overlaps the compute between the two loads."""
        rows = self._ahead.pop(a.mb) if a.mb in self._ahead else self._read_rows()
        if self.grid.holds_first:
            self._inputs[(a.mb, 0)] = rows[0]
        if self.grid.holds_last:
            self._labels[a.mb] = rows[1]
        later = [mb for mb in self._loads if mb > a.mb]
        if self.device.type != "cpu" and later:
            self._ahead[later[0]] = self._read_rows()

    def _read_rows(self) -> tuple:
        batch = self._next_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError("hethub: data_iter must yield (inputs, labels) per micro-batch")
        inputs, labels = batch
        return (self._rows(inputs, "inputs") if self.grid.holds_first else None,
                self._rows(labels, "labels") if self.grid.holds_last else None)

    def _rows(self, x, what: str):
        """This replica's rows of a whole micro-batch (a tensor or a tuple of tensors), on the device (from
        pinned host memory, not waited for, on a GPU)."""
        lo, hi = self.grid.sample_start, self.grid.sample_stop
        for t in as_tuple(x):
            if not torch.is_tensor(t):
                raise ValueError(f"hethub: {what} must be a tensor, got {type(t).__name__}")
            if t.shape[0] != self.micro_batch_size:
                raise ValueError(f"hethub: {what} has {t.shape[0]} rows; the plan's micro_batch_size is "
                                 f"{self.micro_batch_size}")
        pin = self.device.type == "cuda"
        mine = tuple((t[lo:hi].pin_memory() if pin and t.device.type == "cpu" else t[lo:hi]).to(self.device,
                                                                                               non_blocking=pin)
                     for t in as_tuple(x))
        return mine if isinstance(x, tuple) else mine[0]

    # ------------------------------------------------------------------ compute
    def _forward(self, a: Action) -> None:
        k = self._at(a)
        key, last = (a.mb, k), k == self.last_position
        if k > 0:
            received = self.transport.take("A", a.mb, k)
            self._inputs[key] = tuple(received) if len(received) > 1 else received[0]
        inputs = self._guard_inplace(k, self._inputs[key])
        capture = (self._linears.capturing() if key in self._split and torch.is_grad_enabled()
                   else contextlib.nullcontext())
        with capture as calls:  # under the iteration's autocast (_precision)
            outputs = self.module(inputs, chunk=self.grid.local_chunk(k))
            if calls is not None:
                self._linear_calls[key] = calls
            if last:
                labels = self._labels.pop(a.mb)
                loss = self.module.loss_fn(outputs, labels) if self.module.loss_fn is not None else outputs
        if k in self._probe:  # the chunk's first forward with gradients: did it write into its inputs?
            self._writes_inputs[k] = any(c._version != v for c, v in self._probe.pop(k))
        if k == 0 or not torch.is_grad_enabled():
            self._inputs.pop(key)  # nothing to send upstream: no need to keep the input
        if last:
            self._keep_loss(key, loss)
        else:
            self._outputs[key] = outputs

    def _guard_inplace(self, k: int, inputs):
        """What a chunk's forward is given: its inputs, or clones of them where the chunk writes into what it is
        given (a stage starting with ``nn.ReLU(inplace=True)``, as DeepSpeed's tutorial cuts). A received
        activation is an autograd leaf the input gradient is read from, which an in-place op must not touch
        (DeepSpeed clones every received activation). Clones are made only while they are needed: the first
        forward of each chunk with gradients runs on clones and looks whether their version counters moved; a chunk
        that wrote into none gets its inputs as they are from then on. Integer inputs (ids, masks) are always
        cloned: cheap, and a layer may fill them in place."""
        wrote = self._writes_inputs.get(k)
        grads = torch.is_grad_enabled()
        if wrote is False or not grads:
            clones = [t.clone() if torch.is_tensor(t) and not t.is_floating_point() else t for t in as_tuple(inputs)]
        else:
            clones = [t.clone() if torch.is_tensor(t) else t for t in as_tuple(inputs)]
        if wrote is None and grads:
            self._probe[k] = [(c, c._version) for c in clones if torch.is_tensor(c) and c.is_floating_point()]
        return tuple(clones) if isinstance(inputs, tuple) else clones[0]

    def _keep_loss(self, key: tuple[int, int], loss) -> None:
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError("hethub: loss_fn must return a scalar tensor (mean over the given samples)")
        # Mean over this replica's samples -> its share of the mean over the whole batch.
        loss = loss * (self.rows / self._loss_denominator)
        detached = loss.detach()
        self.total_loss = detached.clone() if self.total_loss is None else self.total_loss + detached
        if torch.is_grad_enabled():
            self._losses[key] = loss

    def _backward(self, a: Action) -> None:
        k = self._at(a)
        key = (a.mb, k)
        if k == self.last_position:  # the scaled loss: every gradient upstream, boundaries included, carries it
            loss = self._losses.pop(key)
            roots = [loss * self.loss_scale if self.loss_scale != 1.0 else loss] if loss.requires_grad else []
            grads = None
        else:
            roots = [o for o in as_tuple(self._outputs.pop(key)) if _wants_grad(o)]
            grads = self.transport.take("G", a.mb, k, like=roots) if roots else None
        if not roots:  # frozen up to here: no weight of this chunk or before it wants a gradient
            if key in self._split:
                self._wgrad[key] = None  # its W has nothing to do
            return
        if key not in self._split:
            torch.autograd.backward(tensors=roots, grad_tensors=grads)
            return
        # zb-h1, zb-v: the input gradients now (SG sends them next), the weights' at this micro-batch's W
        inputs = [t for t in as_tuple(self._inputs[key]) if _wants_grad(t)]
        if not inputs:  # frozen upstream: no input gradient to send, the whole backward is weight work, at W
            self._wgrad[key] = (roots, grads)
            return
        weights = self.module.chunk_parameters(self.grid.local_chunk(k))
        try:
            self._wgrad[key] = split_backward.backward_input(roots, grads, inputs, weights, self.grid.stage_id,
                                                             self._linear_calls.pop(key, ()),
                                                             self._walks.setdefault(k, split_backward.WalkCache()))
        except split_backward.SplitBackwardError as exc:  # the model, not a bug: one line (peers see it lost)
            print_error(f"rank {self.grid.global_rank}: {exc}")
            os._exit(2)  # not SystemExit: gloo's threads may still hold the process

    def _weight(self, a: Action) -> None:
        k = self._at(a)
        with self.emulated.weight_pass(k) if self.emulated is not None else contextlib.nullcontext():
            weights = self.module.chunk_parameters(self.grid.local_chunk(k))
            pending = self._wgrad.pop((a.mb, k))
            if isinstance(pending, tuple):  # a backward deferred whole (no input wanted a gradient)
                torch.autograd.backward(tensors=pending[0], grad_tensors=pending[1])
            elif pending is not None:
                split_backward.backward_weight(weights, pending, on_ready=self.gradients.ready)

    # ------------------------------------------------------------------ transfers
    def _send_activations(self, a: Action) -> None:
        self.transport.send_activations(a.mb, as_tuple(self._outputs[(a.mb, self._at(a))]), a.transfers, self._at(a))

    def _recv_activations(self, a: Action) -> None:
        self.transport.recv_activations(a.mb, a.transfers, self._at(a))

    def _send_grads(self, a: Action) -> None:
        """The input gradients (replicated over a tensor-parallel group: its lead sends them once)."""
        inputs = [t for t in as_tuple(self._inputs.pop((a.mb, self._at(a)))) if _wants_grad(t)]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        self.transport.send_grads(a.mb, grads, a.transfers, self._at(a))

    def _recv_grads(self, a: Action) -> None:
        outputs = [o for o in as_tuple(self._outputs[(a.mb, self._at(a))]) if _wants_grad(o)]
        self.transport.recv_grads(a.mb, outputs, a.transfers, self._at(a))
