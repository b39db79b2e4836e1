"""DeepSpeed's pipeline engine, running a hethub plan: stages of unequal width and uneven sample splits.

A plugin on an unmodified DeepSpeed 0.19.x. Where DeepSpeed assumes equal widths, this module
replaces its behaviour (each point measured in shared/NOTES.md):

- ``PipelineEngine.__init__`` (dense grid asserts, batch arithmetic, a blocking one-to-one
  warm-up send) is skipped: ``DeepSpeedEngine.__init__`` runs with ``HeteroGrid`` as mpu, then
  the pipeline state is set here.
- ``_INSTRUCTION_MAP`` holds the base class's functions, so the map is rebuilt for this class.
- Boundary transfers are slice-aware: a replica sends exactly the overlapping rows of each micro-
  batch to each downstream replica that owns them, and receives gradients back the same way, all
  through ``hethub.kernels.pack/unpack``.
- Gradient scaling: each replica's loss is its per-sample mean times ``samples / global_batch``;
  summing gradients within a stage's replicas then gives the gradient of the global mean loss.
  DeepSpeed's gradient-accumulation division is never applied (backward is called directly).
- Clipping uses the true global norm: each stage's squared norm counted once, not per replica
  (DeepSpeed's ``clip_grad_norm_`` counts model-parallel rank 0 and a group that does not exist).
- The loss returned by ``train_batch``/``eval_batch`` is the global mean, broadcast to every rank.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .kernels import pack, unpack, wire_dtype_for, wire_layout
from .topology import HeteroGrid

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
        for f in self.forward_funcs:
            x = f(*x) if isinstance(x, tuple) and getattr(f, "_star_args", False) else f(x)
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


def _is_comm_failure(exc: Exception) -> bool:
    text = str(exc).lower()
    return isinstance(exc, getattr(dist, "DistBackendError", ())) or any(
        k in text for k in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe",
                            "gloo", "peer"))


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class HeteroPipelineEngine(PipelineEngine):
    """Executes DeepSpeed's 1F1B ``TrainSchedule`` under a hethub plan."""

    def __init__(self, *, plan, grid: HeteroGrid, module: HeteroPipelineModule, config: dict, config_class,
                 optimizer=None, model_parameters=None, lr_scheduler=None):
        DeepSpeedEngine.__init__(self, args=None, model=module, optimizer=optimizer,
                                 model_parameters=model_parameters, lr_scheduler=lr_scheduler, mpu=grid,
                                 config=config, config_class=config_class)
        self.plan = plan
        self.grid = grid
        self.enable_backward_allreduce = False  # gradients are reduced at the ReduceGrads instruction
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
        self.num_pipe_buffers = 0
        self.pipe_buffers = {"inputs": [], "labels": [], "outputs": [], "output_tensors": []}
        self.total_loss = None
        self.agg_train_loss = None
        self.agg_eval_loss = None
        self.dynamic_shape = False
        self._recv_meta = None  # [(dtype, trailing shape, requires_grad)] of the tensors from the previous stage
        self._meta_sent = False
        self._global_batch = plan.global_batch_size
        self.autocast_dtype = None  # torch.bfloat16 under "bf16": {"enabled": true} (set by hethub.initialize)
        # DeepSpeed builds this map from the *base class's* functions; subclass overrides only run via our map.
        self._INSTRUCTION_MAP = {
            schedule.OptimizerStep: HeteroPipelineEngine._exec_optimizer_step,
            schedule.ReduceGrads: HeteroPipelineEngine._exec_reduce_grads,
            schedule.ReduceTiedGrads: HeteroPipelineEngine._exec_reduce_tied_grads,
            schedule.LoadMicroBatch: HeteroPipelineEngine._exec_load_micro_batch,
            schedule.ForwardPass: HeteroPipelineEngine._exec_forward_pass,
            schedule.BackwardPass: HeteroPipelineEngine._exec_backward_pass,
            schedule.SendActivation: HeteroPipelineEngine._exec_send_activations,
            schedule.RecvActivation: HeteroPipelineEngine._exec_recv_activations,
            schedule.SendGrad: HeteroPipelineEngine._exec_send_grads,
            schedule.RecvGrad: HeteroPipelineEngine._exec_recv_grads,
        }

    # ------------------------------------------------------------------ batches
    def train_batch(self, data_iter: Optional[Iterator] = None):
        """One iteration over the plan's global batch; returns the global mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.total_loss = None
        self._compute_loss = True
        self._loss_denominator = self._global_batch
        sched = schedule.TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                       stage_id=self.stage_id)
        self._exec_schedule(sched)
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
        self._compute_loss = True
        self._loss_denominator = micro_batches * self.plan.micro_batch_size
        sched = schedule.InferenceSchedule(micro_batches=micro_batches, stages=self.num_stages,
                                           stage_id=self.stage_id)
        with torch.no_grad():
            self._exec_schedule(sched)
        self.agg_eval_loss = self._guarded(self._aggregate_total_loss, "loss broadcast")
        self.module.train()
        return self.agg_eval_loss

    def _exec_schedule(self, pipe_schedule):
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"hethub: pipeline instruction {type(cmd).__name__} is not supported")
                self._peers_in_flight = ()
                self._guarded(lambda: self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs), type(cmd).__name__)

    def _guarded(self, fn, what: str):
        """Run fn; a communication failure (a peer died or hung) ends this rank at once with one line."""
        try:
            return fn()
        except RuntimeError as exc:
            if not _is_comm_failure(exc):
                raise
            self._lost_peer(what, exc)

    def _lost_peer(self, what: str, exc: Exception) -> None:
        """A peer died or hung: end this rank at once with one line naming who it was waiting for."""
        peers = getattr(self, "_peers_in_flight", ()) or tuple(range(self.grid.world_size))
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        print(f"error: rank {self.global_rank} (stage {self.stage_id}) lost rank(s) "
              f"{', '.join(map(str, sorted(set(peers) - {self.global_rank})))} during {what} at "
              f"step {self.global_steps}: {first}", file=sys.stderr, flush=True)
        os._exit(3)  # not SystemExit: gloo's threads may still hold the process

    def _aggregate_total_loss(self) -> torch.Tensor:
        """Sum of every replica's sample-weighted loss (already divided by the batch), on every rank."""
        with torch.no_grad():
            if self.stage_id == self.num_stages - 1:
                loss = self.total_loss.detach().clone().float().reshape(1)
                if self.is_data_parallel:
                    dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
            else:
                loss = torch.zeros(1, dtype=torch.float32, device=self.device)
            if self.is_pipe_parallel:
                dist.broadcast(loss, src=self.grid.last_stage_root)
        return loss[0]

    # ------------------------------------------------------------------ data
    def set_dataiterator(self, iterator):
        if self.stage_id == 0 or self.stage_id == self.num_stages - 1:
            self.training_dataloader = None
            self.data_iterator = iterator

    def _exec_load_micro_batch(self, buffer_id: int):
        batch = self._next_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError("hethub: data_iter must yield (inputs, labels) per micro-batch")
        inputs, labels = batch
        a, b = self.grid.sample_start, self.grid.sample_stop
        mb = self.plan.micro_batch_size

        def rows(t, what):
            if not torch.is_tensor(t):
                raise ValueError(f"hethub: {what} must be a tensor, got {type(t).__name__}")
            if t.shape[0] != mb:
                raise ValueError(f"hethub: {what} has {t.shape[0]} rows; the plan's micro_batch_size is {mb}")
            return t[a:b].to(self.device)

        if self.stage_id == 0:
            local = tuple(rows(t, "inputs") for t in _as_tuple(inputs))
            self.pipe_buffers["inputs"][buffer_id] = local if isinstance(inputs, tuple) else local[0]
        if self.stage_id == self.num_stages - 1:
            local = tuple(rows(t, "labels") for t in _as_tuple(labels))
            self.pipe_buffers["labels"][buffer_id] = local if isinstance(labels, tuple) else local[0]

    # ------------------------------------------------------------------ compute
    def _exec_forward_pass(self, buffer_id: int):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        if isinstance(inputs, tuple):
            inputs = tuple(t.clone() if not t.is_floating_point() else t for t in inputs)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            outputs = self.module(inputs)
            if self.stage_id == self.num_stages - 1:
                labels = self.pipe_buffers["labels"][buffer_id]
                loss = self.module.loss_fn(outputs, labels) if self.module.loss_fn is not None else outputs
        self.pipe_buffers["outputs"][buffer_id] = outputs
        if self.stage_id == self.num_stages - 1:
            if not (torch.is_tensor(loss) and loss.numel() == 1):
                raise ValueError("hethub: loss_fn must return a scalar tensor (mean over the given samples)")
            # Mean over this replica's samples -> its share of the mean over the whole batch.
            self.loss = loss * (self.micro_batch_size / self._loss_denominator)
            detached = self.loss.detach()
            self.total_loss = detached.clone() if self.total_loss is None else self.total_loss + detached

    def _exec_backward_pass(self, buffer_id: int):
        if self.stage_id == self.num_stages - 1:
            self.loss.backward()
        else:
            outputs = _as_tuple(self.pipe_buffers["outputs"][buffer_id])
            grads = self.grad_layer
            pairs = [(o, g) for o, g in zip([o for o in outputs if o.is_floating_point() and o.requires_grad], grads)]
            torch.autograd.backward(tensors=[o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        self.pipe_buffers["outputs"][buffer_id] = None
        self.grad_layer = None

    # ------------------------------------------------------------------ boundary transfers
    def _send_meta(self, outputs: tuple):
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        meta[0] = len(outputs)
        pos = 1
        for t in outputs:
            meta[pos] = _DTYPES.index(t.dtype)
            meta[pos + 1] = int(t.is_floating_point() and t.requires_grad)
            meta[pos + 2] = t.dim() - 1
            meta[pos + 3:pos + 2 + t.dim()] = torch.tensor(t.shape[1:], dtype=torch.int64)
            pos += 2 + t.dim()
        if pos > _META_LEN:
            raise ValueError("hethub: too many or too high-dimensional tensors cross a stage boundary")
        ops = [dist.P2POp(dist.isend, meta, p.peer) for p in self.grid.next_peers]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def _recv_meta_from_prev(self):
        metas = [torch.zeros(_META_LEN, dtype=torch.int64) for _ in self.grid.prev_peers]
        ops = [dist.P2POp(dist.irecv, m, p.peer) for m, p in zip(metas, self.grid.prev_peers)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if any(not torch.equal(m, metas[0]) for m in metas):
            raise RuntimeError("hethub: replicas of the previous stage send tensors of different shapes")
        m, out, pos = metas[0].tolist(), [], 1
        for _ in range(m[0]):
            dtype, req, nd = _DTYPES[m[pos]], bool(m[pos + 1]), m[pos + 2]
            out.append((dtype, tuple(m[pos + 3:pos + 3 + nd]), req))
            pos += 3 + nd
        self._recv_meta = out

    def _exchange(self, send: list[tuple[torch.Tensor, int]], recv: list[tuple[torch.Tensor, int]], group=None):
        self._peers_in_flight = tuple(r for _, r in send) + tuple(r for _, r in recv)
        ops = ([dist.P2POp(dist.isend, t, r, group=group) for t, r in send] +
               [dist.P2POp(dist.irecv, t, r, group=group) for t, r in recv])
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def _transport(self, boundary):
        """(process group, through host memory?) for a boundary: the bridge uses the gloo group on host buffers."""
        if boundary is not None and boundary.transport == "host":
            return self.grid.host_group, True
        return None, False

    def _send_rows(self, tensors: Sequence[torch.Tensor], peers, boundary) -> None:
        """Send each peer its overlapping rows of every tensor, packed (and cast to the boundary's wire dtype)."""
        base = self.grid.sample_start
        ranges = [(p.start - base, p.stop - base) for p in peers]
        group, host = self._transport(boundary)
        wire = boundary.dtype if boundary is not None else None
        sends = []
        for t in tensors:
            t = t.detach()
            if t.is_floating_point():
                buf = pack(t, ranges, wire_dtype_for(t.dtype, wire))
            else:  # integer side inputs (masks, ids) travel as they are
                buf = torch.cat([t[a:b] for a, b in ranges]) if ranges else t[:0]
            if host and buf.device.type != "cpu":
                buf = buf.to("cpu", non_blocking=False)
            off = 0
            for (a, b), p in zip(ranges, peers):
                sends.append((buf[off:off + b - a].contiguous(), p.peer))
                off += b - a
        self._exchange(sends, [], group)

    def _recv_rows(self, specs: Sequence[tuple[torch.dtype, tuple]], peers, boundary) -> list[torch.Tensor]:
        """Receive this replica's rows of each tensor (dtype, trailing shape) from its peers; unpack and up-cast."""
        base, n = self.grid.sample_start, self.micro_batch_size
        ranges = [(p.start - base, p.stop - base) for p in peers]
        group, host = self._transport(boundary)
        wire = boundary.dtype if boundary is not None else None
        where = "cpu" if host else self.device
        recvs, layouts = [], []
        for dtype, shape in specs:
            wdt = wire_dtype_for(dtype, wire) if dtype.is_floating_point else None
            bdt, row_shape = wire_layout(dtype, shape, wdt)
            layouts.append(bdt)
            for (a, b), p in zip(ranges, peers):
                recvs.append((torch.empty((b - a, *row_shape), dtype=bdt, device=where), p.peer))
        self._exchange([], recvs, group)
        out, k = [], 0
        for (dtype, shape), bdt in zip(specs, layouts):
            pieces = [recvs[k + i][0] for i in range(len(ranges))]
            k += len(ranges)
            buf = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).to(self.device)
            full = torch.empty((n, *shape), dtype=dtype, device=self.device)
            if dtype.is_floating_point:
                unpack(buf, full, ranges)
            else:
                off = 0
                for a, b in ranges:
                    full[a:b].copy_(buf[off:off + b - a])
                    off += b - a
            out.append(full)
        return out

    def _exec_send_activations(self, buffer_id: int):
        outputs = _as_tuple(self.pipe_buffers["outputs"][buffer_id])
        if not self._meta_sent:
            self._send_meta(outputs)
            self._meta_sent = True
        self._send_rows(outputs, self.grid.next_peers, self.grid.next_boundary)

    def _exec_recv_activations(self, buffer_id: int):
        if self._recv_meta is None:
            self._recv_meta_from_prev()
        received = self._recv_rows([(d, s) for d, s, _ in self._recv_meta], self.grid.prev_peers,
                                   self.grid.prev_boundary)
        for t, (_, _, req) in zip(received, self._recv_meta):
            t.requires_grad_(req)
        self.pipe_buffers["inputs"][buffer_id] = tuple(received) if len(received) > 1 else received[0]

    def _exec_send_grads(self, buffer_id: int):
        inputs = [t for t in _as_tuple(self.pipe_buffers["inputs"][buffer_id])
                  if t.is_floating_point() and t.requires_grad]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        self._send_rows(grads, self.grid.prev_peers, self.grid.prev_boundary)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int):
        outputs = [o for o in _as_tuple(self.pipe_buffers["outputs"][buffer_id])
                   if o.is_floating_point() and o.requires_grad]
        self.grad_layer = self._recv_rows([(o.dtype, tuple(o.shape[1:])) for o in outputs], self.grid.next_peers,
                                          self.grid.next_boundary)

    # ------------------------------------------------------------------ gradients and step
    def _exec_reduce_tied_grads(self):
        return None  # tied layers are refused at initialize

    def _exec_reduce_grads(self):
        """SUM within the stage's replicas: each replica's loss already carries samples / global batch."""
        if not self.is_data_parallel:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.grid.get_data_parallel_group())
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def clip_fp32_gradients(self):
        """Clip by the global norm: each stage's squared norm once (replica 0 contributes), summed over stages."""
        max_norm = self.gradient_clipping()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.grid.replica_id == 0 and grads:
            sq += sum(g.detach().double().pow(2).sum() for g in grads)
        dist.all_reduce(sq)
        total = float(sq.sqrt())
        self._global_grad_norm = total
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)

    def _exec_optimizer_step(self, lr_kwargs=None):
        samples = self.global_samples
        self._force_grad_boundary = True
        self._take_model_step(lr_kwargs)
        self._force_grad_boundary = False
        self.global_samples = samples + self._global_batch  # DeepSpeed counts this rank's share only

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

    def reset_activation_shape(self):
        self._recv_meta = None
        self._meta_sent = False
