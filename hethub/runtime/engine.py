"""DeepSpeed's pipeline engine, running a hethub plan and hethub's schedule.

A plugin on an unmodified DeepSpeed 0.19.x. ``DeepSpeedEngine`` keeps what it is good at (config,
optimizer and LR scheduler wiring, the optimizer step); the pipeline itself runs here:

- **The schedule is hethub's.** Each rank executes its action list from
  ``partitioner.schedule.build_schedule`` (or a hand-edited schedule file), the same list
  ``hethub simulate`` replays, and records what it ran (``engine.executed``). DeepSpeed's
  ``TrainSchedule`` is not used: its instructions pair blocking sends with receives step by step,
  which couples neighbouring stages (a stage waits for its neighbour's progress, not just for
  data), and its buffers are ring slots that cannot express receives posted ahead.
- **Transfers are non-blocking.** ``SA``/``SG`` post ``isend``s of exactly the rows each peer owns
  (packed and cast by ``hethub.kernels.pack``) and return; ``RA``/``RG`` post ``irecv``s ahead of
  use; a forward or backward waits only for the rows it needs. Sends still in flight are waited for
  at the end of the iteration.
- ``PipelineEngine.__init__`` (dense grid asserts, batch arithmetic, a blocking one-to-one warm-up
  send) is skipped: ``DeepSpeedEngine.__init__`` runs with ``HeteroGrid`` as mpu.
- Gradient scaling: each replica's loss is its per-sample mean times ``samples / global_batch``;
  summing gradients within a stage's replicas then gives the gradient of the global mean loss.
  DeepSpeed's gradient-accumulation division is never applied (backward is called directly).
- Clipping uses the true global norm: each stage's squared norm counted once, not per replica
  (DeepSpeed's ``clip_grad_norm_`` counts model-parallel rank 0 and a group that does not exist).
- The loss returned by ``train_batch``/``eval_batch`` is the global mean, broadcast to every rank.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.checkpoint import checkpoint

from . import ds_seams
from . import split_backward
from ..kernels import WIRE_DTYPES, pack, unpack, wire_dtype_for, wire_layout
from ..partitioner.errors import print_error
from ..partitioner.schedule import Action, build_schedule
from .grid import HeteroGrid
from .tp import is_sharded, local

ds_seams.check()  # the DeepSpeed names below that are not public API exist in this DeepSpeed

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_META_LEN = 64  # int64 slots of one tensor-metadata message


class HeteroPipelineModule(PipelineModule):
    """The layers of one stage, taken from the plan's layer range (not DeepSpeed's partition methods).

    ``PipelineModule.__init__`` is not called: it builds a dense ``PipelineParallelGrid`` and its own
    partition. This keeps the attributes DeepSpeed's engine reads.
    """

    def __init__(self, layers: Sequence[Any], loss_fn: Optional[Callable], grid: HeteroGrid):
        nn.Module.__init__(self)
        start, stop = grid.stage.layers
        local = []
        for idx in range(start, stop):
            spec = layers[idx]
            if isinstance(spec, nn.Module):
                local.append(spec)
            elif hasattr(spec, "build"):  # deepspeed.pipe.LayerSpec
                local.append(spec.build())
            elif callable(spec):
                local.append(_Lambda(spec))
            else:
                raise TypeError(f"layers[{idx}]: expected an nn.Module, a LayerSpec or a callable, got {type(spec)}")
        self.forward_funcs = local
        self.local_layers = nn.ModuleList([m for m in local if isinstance(m, nn.Module)])
        self.loss_fn = loss_fn
        self._grid = grid
        self._topo = None
        self._local_start, self._local_stop = start, stop
        self.num_stages = grid.pipe_parallel_size
        self.stage_id = grid.stage_id
        self.global_rank = grid.global_rank
        self.micro_offset = 0
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs = {}
        self.tied_comms = {}
        self.activation_checkpoint_interval = 0
        self.activation_checkpoint_func = None
        self.checkpointable_layers = None
        self.dynamic_shape = False
        self.checkpoint_parallel_write_pipeline = False

    def forward(self, x):
        # A plan's recompute stage keeps only each layer's input and runs the layer's forward again in its
        # backward (what the cost model charges: memory ``act_bytes_recompute``, one more forward). Non-
        # reentrant checkpointing: it keeps autograd's graph, so zb-h1 can still split the backward.
        recompute = self._grid.stage.recompute and torch.is_grad_enabled()
        for f in self.forward_funcs:
            x = checkpoint(f, x, use_reentrant=False) if recompute else f(x)
        return x

    def mpu(self):
        return self._grid

    def topology(self):
        return None

    def get_tied_weights_and_groups(self):
        return []

    def get_additional_losses(self):
        return None


class _Lambda(nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class HeteroPipelineEngine(PipelineEngine):
    """Executes hethub's per-rank schedule (1F1B, non-blocking transfers) under a hethub plan."""

    def __init__(self, *, plan, grid: HeteroGrid, module: HeteroPipelineModule, config: dict, config_class,
                 optimizer=None, model_parameters=None, lr_scheduler=None, schedule: Optional[list] = None):
        DeepSpeedEngine.__init__(self, args=None, model=module, optimizer=optimizer,
                                 model_parameters=model_parameters, lr_scheduler=lr_scheduler, mpu=grid,
                                 config=config, config_class=config_class,
                                 # tensor-parallel (DTensor) parameters were placed before being split
                                 dont_change_device=grid.tp > 1)
        self.plan = plan
        self.grid = grid
        self.enable_backward_allreduce = False  # gradients are reduced at the AR action
        self.pipeline_enable_backward_allreduce = True
        self.has_bool_tensors = False
        self.eval_return_logits = False
        self.outputs = None
        self.using_bf16_optimizer = False
        self.log_batch_step_id = -1
        self.micro_batch_size = grid.sample_stop - grid.sample_start  # this replica's rows
        self.micro_batches = plan.num_micro_batches
        self.global_rank = grid.global_rank
        self.num_stages = grid.pipe_parallel_size
        self.stage_id = grid.stage_id
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1
        self.data_iterator = None
        self.batch_fn = None
        self._force_grad_boundary = False
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = grid.data_parallel_size > 1
        self.is_model_parallel = False
        self.is_pipe_partitioned = False
        self.is_grad_partitioned = False
        self.total_loss = None
        self.agg_train_loss = None
        self.agg_eval_loss = None
        self.dynamic_shape = False
        self._recv_meta = None  # [(dtype, trailing shape, requires_grad)] of the tensors from the previous stage
        self._recv_meta_lead = None  # ... as the lead received it (shared with a tensor-parallel group once)
        self._meta_sent = False
        self._global_batch = plan.global_batch_size
        self.autocast_dtype = None  # torch.bfloat16 under "bf16": {"enabled": true} (set by hethub.initialize)
        self.emulate_slowdown = 1.0  # emulated heterogeneity (hethub.emulation), set by hethub.initialize
        self._emulated_w_ref: dict[str, float] = {}  # the fastest weight pass seen
        # ZeRO-1 (hethub.zero): this replica's flat shards of the optimizer's groups; None without it
        self.zero1 = None
        self.ties: tuple = ()  # every tied weight of the layer list (hethub.ties), set by hethub.initialize
        self._tied_params: dict = {}  # tie -> this stage's Parameter of it
        # This rank's training actions: the plan's 1F1B or a hand-edited schedule (checked before launch).
        self.schedule = list(schedule) if schedule is not None else build_schedule(plan)[grid.schedule_rank]
        self.executed: list[str] = []  # the actions of the last train_batch/eval_batch, as text, in order
        # (start, end, seconds waiting for data) of each of them, perf_counter seconds
        self.executed_s: list[tuple[float, float, float]] = []
        self._waited_s = 0.0
        self._linears: Optional[split_backward.LinearCalls] = None  # hooks recording Linear calls, made at first zb-h1
        self._reset_iteration()

    def _broadcast_model(self):
        """DeepSpeed's start-up broadcast of the weights within the data-parallel group, on each rank's own
        tensors: with tensor parallelism a parameter is a DTensor, and the group is the ranks holding the
        same shard (called from DeepSpeedEngine.__init__, so it reads ``self.mpu``)."""
        grid = self.mpu
        if grid.data_parallel_size == 1:
            return
        for p in self.module.parameters():
            dist.broadcast(local(p).data, src=grid.dp_ranks[0], group=grid.get_data_parallel_group())

    def _reset_iteration(self) -> None:
        self._inputs: dict[int, Any] = {}  # micro-batch -> this stage's input (loaded or received)
        self._labels: dict[int, Any] = {}
        self._outputs: dict[int, Any] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._recvs: dict[tuple[str, int], tuple] = {}  # ("A"|"G", mb) -> posted receive
        self._sends: list[tuple[Any, torch.Tensor]] = []  # (work, buffer) in flight
        self._wgrad: dict[int, split_backward.Pending] = {}  # micro-batch -> where its weight pass resumes (zb-h1)
        self._linear_calls: dict[int, list] = {}  # micro-batch -> its forward's plain Linear calls (zb-h1)

    # ------------------------------------------------------------------ batches
    def train_batch(self, data_iter: Optional[Iterator] = None):
        """One iteration over the plan's global batch; returns the global mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.total_loss = None
        self._loss_denominator = self._global_batch
        self._run(self.schedule)
        self.agg_train_loss = self._guarded(self._aggregate_total_loss, "loss broadcast")
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: Optional[int] = None):
        """Forward only over ``num_micro_batches`` (default: the plan's); returns the mean loss on every rank."""
        if return_logits or not compute_loss or reduce_output != "avg":
            raise NotImplementedError("hethub eval_batch supports the mean loss only (return_logits=False, "
                                      "compute_loss=True, reduce_output='avg')")
        self.module.eval()
        micro_batches = num_micro_batches or self.micro_batches
        self.set_dataiterator(data_iter)
        self.total_loss = None
        self._loss_denominator = micro_batches * self.plan.micro_batch_size
        actions = build_schedule(self.plan, train=False, num_micro_batches=micro_batches)[self.grid.schedule_rank]
        with torch.no_grad():
            self._run(actions)
        self.agg_eval_loss = self._guarded(self._aggregate_total_loss, "loss broadcast")
        self.module.train()
        return self.agg_eval_loss

    def _run(self, actions: Sequence[Action]) -> None:
        """Execute one iteration's actions in order; every send has landed when this returns."""
        self._reset_iteration()
        self.executed, self.executed_s = [], []
        handlers = {"L": self._act_load, "F": self._act_forward, "B": self._act_backward,
                    "SA": self._act_send_activations, "RA": self._act_recv_activations,
                    "SG": self._act_send_grads, "RG": self._act_recv_grads,
                    "W": self._act_weight, "AR": lambda a: self._exec_reduce_grads(),
                    "OPT": lambda a: self._exec_optimizer_step()}
        self._split_mbs = {a.mb for a in actions if a.kind == "W"}  # their B computes input gradients only
        self._weights = [p for p in self.module.parameters() if p.requires_grad] if self._split_mbs else []
        if self._split_mbs and self._linears is None:
            self._linears = split_backward.LinearCalls(self.module)
        for a in actions:
            self._peers_in_flight = tuple(t.peer for t in a.transfers)
            t0, self._waited_s = time.perf_counter(), 0.0
            self._what = str(a)
            handlers[a.kind](a)  # a user's layer or loss raising here shows its own traceback
            self.executed.append(str(a))
            self.executed_s.append((t0, time.perf_counter(), self._waited_s))
        self._peers_in_flight = ()
        self._what = "the iteration's last sends"
        self._wait_sends()

    def _guarded(self, fn, what: str):
        """Run a communication call; its failure (a peer died or hung) ends this rank at once with one line.
        Only hethub's own transfers and collectives go through here, so a user's error is never taken
        for a lost peer."""
        try:
            return fn()
        except RuntimeError as exc:
            self._lost_peer(what, exc)

    def _lost_peer(self, what: str, exc: Exception) -> None:
        """A peer died or hung: end this rank at once with one line naming who it was waiting for."""
        peers = getattr(self, "_peers_in_flight", ()) or tuple(range(self.grid.world_size))
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        print_error(f"rank {self.global_rank} (stage {self.stage_id}) lost rank(s) "
                    f"{', '.join(map(str, sorted(set(peers) - {self.global_rank})))} during {what} at "
                    f"step {self.global_steps}: {first}")
        os._exit(3)  # not SystemExit: gloo's threads may still hold the process

    def _aggregate_total_loss(self) -> torch.Tensor:
        """Sum of every replica's sample-weighted loss (already divided by the batch), on every rank."""
        with torch.no_grad():
            if self.stage_id == self.num_stages - 1:
                loss = self.total_loss.detach().clone().double().reshape(1)  # float64: no rounding on the way
                if self.is_data_parallel:
                    dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
            else:
                loss = torch.zeros(1, dtype=torch.float64, device=self.device)
            if self.is_pipe_parallel:
                dist.broadcast(loss, src=self.grid.last_stage_root)
        return loss[0]

    # ------------------------------------------------------------------ data
    def set_dataiterator(self, iterator):
        if self.stage_id == 0 or self.stage_id == self.num_stages - 1:
            self.training_dataloader = None
            self.data_iterator = iterator

    def _act_load(self, a: Action) -> None:
        batch = self._next_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError("hethub: data_iter must yield (inputs, labels) per micro-batch")
        inputs, labels = batch
        lo, hi = self.grid.sample_start, self.grid.sample_stop
        mb = self.plan.micro_batch_size

        def rows(t, what):
            if not torch.is_tensor(t):
                raise ValueError(f"hethub: {what} must be a tensor, got {type(t).__name__}")
            if t.shape[0] != mb:
                raise ValueError(f"hethub: {what} has {t.shape[0]} rows; the plan's micro_batch_size is {mb}")
            return t[lo:hi].to(self.device)

        if self.stage_id == 0:
            local = tuple(rows(t, "inputs") for t in _as_tuple(inputs))
            self._inputs[a.mb] = local if isinstance(inputs, tuple) else local[0]
        if self.stage_id == self.num_stages - 1:
            local = tuple(rows(t, "labels") for t in _as_tuple(labels))
            self._labels[a.mb] = local if isinstance(labels, tuple) else local[0]

    # ------------------------------------------------------------------ compute
    def _act_forward(self, a: Action) -> None:
        if self.stage_id > 0:
            received = self._take_recv("A", a.mb)
            for t, (_, _, req) in zip(received, self._recv_meta):
                t.requires_grad_(req and torch.is_grad_enabled())
            self._inputs[a.mb] = tuple(received) if len(received) > 1 else received[0]
        inputs = self._inputs[a.mb]
        if isinstance(inputs, tuple):
            inputs = tuple(t.clone() if not t.is_floating_point() else t for t in inputs)
        last = self.stage_id == self.num_stages - 1
        capture = (self._linears.capturing() if a.mb in self._split_mbs and torch.is_grad_enabled()
                   else contextlib.nullcontext())
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None), capture as calls:
            outputs = self.module(inputs)
            if calls is not None:
                self._linear_calls[a.mb] = calls
            if last:
                labels = self._labels.pop(a.mb)
                loss = self.module.loss_fn(outputs, labels) if self.module.loss_fn is not None else outputs
        if self.stage_id == 0 or not torch.is_grad_enabled():
            self._inputs.pop(a.mb)  # nothing to send upstream: no need to keep the input
        if not last:
            self._outputs[a.mb] = outputs
            return
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError("hethub: loss_fn must return a scalar tensor (mean over the given samples)")
        # Mean over this replica's samples -> its share of the mean over the whole batch.
        loss = loss * (self.micro_batch_size / self._loss_denominator)
        detached = loss.detach()
        self.total_loss = detached.clone() if self.total_loss is None else self.total_loss + detached
        if torch.is_grad_enabled():
            self._losses[a.mb] = loss

    def _act_backward(self, a: Action) -> None:
        if self.stage_id == self.num_stages - 1:
            roots, grads = [self._losses.pop(a.mb)], None
        else:
            roots = [o for o in _as_tuple(self._outputs.pop(a.mb)) if o.is_floating_point() and o.requires_grad]
            grads = self._take_recv("G", a.mb, like=roots)
        if a.mb not in self._split_mbs:
            torch.autograd.backward(tensors=roots, grad_tensors=grads)
            return
        # zb-h1: the input gradients now (SG sends them next), the weights' at this micro-batch's W
        inputs = [t for t in _as_tuple(self._inputs[a.mb]) if t.is_floating_point() and t.requires_grad]
        try:
            self._wgrad[a.mb] = split_backward.backward_input(roots, grads, inputs, self._weights, self.stage_id,
                                                              self._linear_calls.pop(a.mb, ()))
        except split_backward.SplitBackwardError as exc:  # the model, not a bug: one line (peers see it lost)
            print_error(f"rank {self.global_rank}: {exc}")
            os._exit(2)  # not SystemExit: gloo's threads may still hold the process

    def _act_weight(self, a: Action) -> None:
        t0 = time.perf_counter()
        split_backward.backward_weight(self._weights, self._wgrad.pop(a.mb))
        if self.emulate_slowdown != 1.0:  # the layers' wrappers slow the input pass; the weight pass is slowed here
            from ..emulated.slowdown import idle_to
            idle_to(self.emulate_slowdown, self._emulated_w_ref, "w", time.perf_counter() - t0)

    # ------------------------------------------------------------------ boundary transfers (non-blocking)
    @staticmethod
    def _encode_meta(tensors: Sequence[tuple[torch.Tensor, bool]]) -> torch.Tensor:
        """(dtype, requires grad, trailing shape) of each (tensor, requires grad) as one int64 message."""
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        meta[0] = len(tensors)
        pos = 1
        for t, req in tensors:
            if pos + 2 + t.dim() > _META_LEN:
                raise ValueError("hethub: too many or too high-dimensional tensors cross a stage boundary")
            meta[pos] = _DTYPES.index(t.dtype)
            meta[pos + 1] = int(req)
            meta[pos + 2] = t.dim() - 1
            meta[pos + 3:pos + 2 + t.dim()] = torch.tensor(t.shape[1:], dtype=torch.int64)
            pos += 2 + t.dim()
        return meta

    @staticmethod
    def _decode_meta(meta: torch.Tensor) -> list[tuple[torch.dtype, tuple, bool]]:
        m, out, pos = meta.tolist(), [], 1
        for _ in range(m[0]):
            dtype, req, nd = _DTYPES[m[pos]], bool(m[pos + 1]), m[pos + 2]
            out.append((dtype, tuple(m[pos + 3:pos + 3 + nd]), req))
            pos += 3 + nd
        return out

    def _send_meta(self, outputs: tuple, peers) -> None:
        meta = self._encode_meta([(t, t.is_floating_point() and t.requires_grad) for t in outputs])
        for p in peers:
            self._sends.append((self._guarded(lambda: dist.isend(meta, p.peer), self._what), meta))

    def _recv_meta_from(self, peers) -> None:
        metas = [torch.zeros(_META_LEN, dtype=torch.int64) for _ in peers]
        for w in [self._guarded(lambda: dist.irecv(m, p.peer), self._what) for m, p in zip(metas, peers)]:
            self._guarded(w.wait, self._what)
        if any(not torch.equal(m, metas[0]) for m in metas):
            raise RuntimeError("hethub: replicas of the previous stage send tensors of different shapes")
        self._recv_meta_lead = self._decode_meta(metas[0])
        if self.grid.tp == 1:
            self._recv_meta = self._recv_meta_lead

    def _transport(self, boundary):
        """(process group, through host memory?) for a boundary: the bridge uses the gloo group on host buffers."""
        if boundary is not None and boundary.transport == "host":
            return self.grid.host_group, True
        return None, False

    def _post_sends(self, tensors: Sequence[torch.Tensor], transfers, boundary) -> None:
        """isend each peer its rows of every tensor, packed (and cast to the boundary's wire dtype)."""
        base = self.grid.sample_start
        ranges = [(t.start - base, t.stop - base) for t in transfers]
        group, host = self._transport(boundary)
        wire = boundary.dtype if boundary is not None else None
        for x in tensors:
            x = x.detach()
            if x.dtype in WIRE_DTYPES:
                buf = pack(x, ranges, wire_dtype_for(x.dtype, wire))
            else:  # integer side inputs (masks, ids) and float64 travel as they are
                buf = torch.cat([x[a:b] for a, b in ranges]) if ranges else x[:0]
            if host and buf.device.type != "cpu":
                buf = buf.to("cpu", non_blocking=False)
            off = 0
            for (a, b), t in zip(ranges, transfers):
                piece = buf[off:off + b - a]
                work = self._guarded(lambda: dist.isend(piece, t.peer, group=group), self._what)
                self._sends.append((work, piece))
                off += b - a

    def _post_recvs(self, kind: str, mb: int, specs: Sequence[tuple[torch.dtype, tuple]], transfers,
                    boundary) -> None:
        """irecv this replica's rows of each tensor (dtype, trailing shape) from the action's peers."""
        base = self.grid.sample_start
        ranges = [(t.start - base, t.stop - base) for t in transfers]
        group, host = self._transport(boundary)
        wire = boundary.dtype if boundary is not None else None
        where = "cpu" if host else self.device
        works, pieces = [], []
        for dtype, shape in specs:
            wdt = wire_dtype_for(dtype, wire) if dtype in WIRE_DTYPES else None
            bdt, row_shape = wire_layout(dtype, shape, wdt)
            for (a, b), t in zip(ranges, transfers):
                buf = torch.empty((b - a, *row_shape), dtype=bdt, device=where)
                works.append(self._guarded(lambda: dist.irecv(buf, t.peer, group=group), self._what))
                pieces.append(buf)
        self._recvs[(kind, mb)] = (works, pieces, specs, ranges)

    @property
    def _is_lead(self) -> bool:
        """This rank talks to the neighbouring stages (every rank without tensor parallelism)."""
        return self.grid.tp_rank == 0

    def _take_recv(self, kind: str, mb: int, like: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """This replica's full tensors of a posted receive. In a tensor-parallel group the lead received them
        and broadcasts them to the others (``like``: tensors of the shapes to expect, for gradients)."""
        out = self._take_own_recv(kind, mb) if self._is_lead else None
        if self.grid.tp > 1:
            out = self._tp_share(kind, out, like)
        return out

    def _tp_share(self, kind: str, tensors: Optional[list], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Broadcast the lead's received tensors over the tensor-parallel group (shapes of activations from
        the lead's meta, shared once; gradients are shaped like this rank's own outputs)."""
        group, lead = self.grid.tp_group, self.grid.tp_lead
        self._peers_in_flight = tuple(self.grid.tp_ranks)
        if kind == "A" and self._recv_meta is None:  # the lead has it from the previous stage
            meta = torch.zeros(_META_LEN, dtype=torch.int64)
            if self._is_lead:
                meta = self._encode_meta([(t, req) for t, (_, _, req) in zip(tensors, self._recv_meta_lead)])
            self._guarded(lambda: dist.broadcast(meta, src=lead, group=group), "the tensor-parallel broadcast")
            self._recv_meta = self._decode_meta(meta)
        if tensors is None:
            n = self.micro_batch_size
            tensors = ([torch.empty((n, *shape), dtype=d, device=self.device) for d, shape, _ in self._recv_meta]
                       if kind == "A" else [torch.empty_like(t) for t in like])
        for t in tensors:
            self._guarded(lambda: dist.broadcast(t, src=lead, group=group), "the tensor-parallel broadcast")
        return tensors

    def _take_own_recv(self, kind: str, mb: int) -> list[torch.Tensor]:
        """Wait for a posted receive; unpack and up-cast its pieces into this replica's full tensors."""
        works, pieces, specs, ranges = self._recvs.pop((kind, mb))
        t0 = time.perf_counter()
        for w in works:
            self._guarded(w.wait, self._what)
        self._waited_s += time.perf_counter() - t0
        out, k, n = [], 0, self.micro_batch_size
        for dtype, shape in specs:
            mine = pieces[k:k + len(ranges)]
            k += len(ranges)
            buf = (torch.cat(mine) if len(mine) > 1 else mine[0]).to(self.device)
            full = torch.empty((n, *shape), dtype=dtype, device=self.device)
            if dtype in WIRE_DTYPES:
                unpack(buf, full, ranges)
            else:
                off = 0
                for a, b in ranges:
                    full[a:b].copy_(buf[off:off + b - a])
                    off += b - a
            out.append(full)
        return out

    def _wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for work, _buf in sends:
            self._guarded(work.wait, self._what)

    def _act_send_activations(self, a: Action) -> None:
        if not self._is_lead:
            return  # the group's lead sends the (replicated) output once
        outputs = _as_tuple(self._outputs[a.mb])
        if not self._meta_sent:
            self._send_meta(outputs, a.transfers)
            self._meta_sent = True
        self._post_sends(outputs, a.transfers, self.grid.next_boundary)

    def _act_recv_activations(self, a: Action) -> None:
        if not self._is_lead:
            return  # the lead receives and shares at the forward (_tp_share)
        if self._recv_meta_lead is None:
            self._recv_meta_from(a.transfers)
        self._post_recvs("A", a.mb, [(d, s) for d, s, _ in self._recv_meta_lead], a.transfers,
                         self.grid.prev_boundary)

    def _act_send_grads(self, a: Action) -> None:
        inputs = [t for t in _as_tuple(self._inputs.pop(a.mb)) if t.is_floating_point() and t.requires_grad]
        if not self._is_lead:
            return
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        self._post_sends(grads, a.transfers, self.grid.prev_boundary)

    def _act_recv_grads(self, a: Action) -> None:
        if not self._is_lead:
            return
        outputs = [o for o in _as_tuple(self._outputs[a.mb]) if o.is_floating_point() and o.requires_grad]
        self._post_recvs("G", a.mb, [(o.dtype, tuple(o.shape[1:])) for o in outputs], a.transfers,
                         self.grid.next_boundary)

    # ------------------------------------------------------------------ gradients and step
    def _stage_collective(self, fn, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Run a collective over the stage's replicas; a stage spanning vendors goes through the host bridge
        (its gloo group, on host buffers), like a cross-vendor boundary."""
        self._peers_in_flight = tuple(self.grid.dp_ranks)
        group = self.grid.stage_bridge_group
        if group is None:
            return self._guarded(lambda: fn(tensor, self.grid.get_data_parallel_group()), what)
        host = tensor.to("cpu")
        out = self._guarded(lambda: fn(host, group), what + " (host bridge)")
        return out.to(tensor.device)

    def _exec_reduce_grads(self):
        """SUM within the stage's replicas: each replica's loss already carries samples / global batch."""
        grads = [local(p.grad) for p in self.module.parameters() if p.grad is not None]  # tensor-parallel: own shard
        if grads and self.is_data_parallel:
            flat = _flatten_dense_tensors(grads)

            def all_reduce(t, group):
                dist.all_reduce(t, group=group)
                return t
            flat = self._stage_collective(all_reduce, flat, "AR")
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self._reduce_tied_grads()
        if self.zero1 is not None:
            self.zero1.load_grads()

    def _tied_parameter(self, tie):
        """This stage's Parameter of a tie (any of its local places: they are one object); looked up once."""
        cache = self._tied_params
        if tie not in cache:
            from .checkpoint import _local_layers
            layers = dict(_local_layers(self))
            idx, name = next((i, n) for i, n in tie.places if i in layers)
            cache[tie] = dict(layers[idx].named_parameters())[name]
        return cache[tie]

    def _reduce_tied_grads(self) -> None:
        """A weight tied across stages: replica 0 of each holding stage gives its stage's (already reduced)
        gradient, the others zeros; the sum over every holder is the single-process gradient (hethub.ties)."""
        for tie, group in self.grid.tie_groups:
            p = self._tied_parameter(tie)
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            first = self.grid.replica_id == 0 and self.grid.tp_rank == 0  # one contribution per stage
            mine = g.detach().clone() if first else torch.zeros_like(g)
            self._peers_in_flight = tuple(dist.get_process_group_ranks(group))
            self._guarded(lambda: dist.all_reduce(mine, group=group), "the tied-weight all-reduce")
            p.grad = mine

    def _norm_parameters(self) -> list:
        """Parameters whose gradients this stage counts in the global norm: a tied weight only on its owner's
        stage."""
        skip = set()
        a, b = self.grid.stage.layers
        for tie, _group in self.grid.tie_groups:
            if not a <= tie.owner[0] < b:
                skip.add(id(self._tied_parameter(tie)))
        return [p for p in self.module.parameters() if p.grad is not None and id(p) not in skip]

    def clip_fp32_gradients(self):
        """Clip by the global norm: each stage's squared norm once (replica 0 contributes), summed over stages.
        In a tensor-parallel group a split parameter's shards add up on every rank; a whole one counts once."""
        max_norm = self.gradient_clipping()
        grads = [local(p.grad) for p in self.module.parameters() if p.grad is not None]
        counted = [local(p.grad) for p in self._norm_parameters() if is_sharded(p) or self.grid.tp_rank == 0]
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.grid.replica_id == 0 and counted:
            sq += sum(g.detach().double().pow(2).sum() for g in counted)
        self._guarded(lambda: dist.all_reduce(sq), "the gradient norm's all-reduce")
        total = float(sq.sqrt())
        self._global_grad_norm = total
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads + (self.zero1.shard_grads() if self.zero1 is not None else []):
                g.mul_(coef)

    def _exec_optimizer_step(self, lr_kwargs=None):
        samples = self.global_samples
        self._force_grad_boundary = True
        self._take_model_step(lr_kwargs)
        self._force_grad_boundary = False
        if self.zero1 is not None:
            self.zero1.gather_parameters(self.all_gather_stage)
        self.global_samples = samples + self._global_batch  # DeepSpeed counts this rank's share only

    def all_gather_stage(self, t: torch.Tensor, what: str = "the ZeRO-1 all-gather") -> torch.Tensor:
        """Concatenation of ``t`` (one size everywhere) over the stage's replicas, in replica order."""
        def gather(x, group):
            parts = [torch.empty_like(x) for _ in range(self.grid.data_parallel_size)]
            dist.all_gather(parts, x, group=group)
            return torch.cat(parts)
        return self._stage_collective(gather, t, what)

    def is_gradient_accumulation_boundary(self):
        return self._force_grad_boundary

    # ------------------------------------------------------------------ checkpoints (per layer: any plan loads them)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **_kw):
        """Collective. Per-layer files that any other plan of the same model can load (hethub.checkpoint)."""
        from . import checkpoint
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, **_kw):
        """Returns (checkpoint path, client_state) like DeepSpeed's engine."""
        from . import checkpoint
        tag, client = checkpoint.load(self, load_dir, tag, load_optimizer_states)
        return os.path.join(load_dir, tag), client

    # ------------------------------------------------------------------ inherited calls a plan cannot honour
    def set_train_batch_size(self, train_batch_size):
        raise NotImplementedError("hethub: the plan fixes the batch (global_batch_size = micro_batch_size x "
                                  "num_micro_batches); make a plan for another batch with `hethub plan`")

    def module_state_dict(self, *args, **kwargs):
        raise NotImplementedError("hethub: use engine.save_checkpoint(dir): per-layer files any plan can load")

    def load_module_state_dict(self, *args, **kwargs):
        raise NotImplementedError("hethub: use engine.load_checkpoint(dir): per-layer files from any plan")

    def get_additional_losses(self):
        """No auxiliary losses (MoE load balancing) under hethub plans."""
        return None

    def reset_activation_shape(self):
        self._recv_meta = None
        self._recv_meta_lead = None
        self._meta_sent = False
