"""The DeepSpeed adapter: a ``PipelineEngine`` that runs a hethub plan by delegating to the runtime's parts.

A plugin on an unmodified DeepSpeed 0.19.x. ``DeepSpeedEngine`` keeps what it is good at (config, optimizer and
LR scheduler wiring, the optimizer step); the pipeline itself is hethub's:

- **The schedule is hethub's** (``executor``): each rank executes its action list, the same list ``hethub
  simulate`` replays, and records what it ran (``engine.executed``). DeepSpeed's ``TrainSchedule`` pairs blocking
  sends with receives step by step, which couples neighbouring stages, and its ring buffers cannot express
  receives posted ahead.
- **Transfers are non-blocking row slices** between stages of unequal width (``transport``).
- **Gradient scaling is exact** (``gradients``): each replica's loss carries ``samples / global_batch``, so SUM
  within a stage is the gradient of the global mean loss; DeepSpeed's gradient-accumulation division is never
  applied (backward is called directly). Clipping uses the true global norm (each stage's squared norm once);
  DeepSpeed's ``clip_grad_norm_`` counts model-parallel rank 0 over a group that does not exist here.
- ``PipelineEngine.__init__`` is bypassed: ``DeepSpeedEngine.__init__`` runs with ``HeteroGrid`` as mpu, and
  the attributes DeepSpeed reads come from ``ds_seams.pipeline_engine_attrs`` (every private name is listed there).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..dsconfig import FP16Section
from ..partitioner.schedule import build_schedule
from . import checkpoint, ds_seams, saving
from .control import Control
from .errors import Guard
from .executor import Executor
from .gradients import BUCKET_BYTES, Gradients, broadcast_weights
from .precision import Precision
from .grid import HeteroGrid
from .module import HeteroPipelineModule
from .transport import Transport

ds_seams.check()  # the DeepSpeed names this adapter uses that are not public API exist in this DeepSpeed


@dataclass(frozen=True)
class Autosave:
    """Saving by itself every ``every_steps`` steps (0: never) into ``dir``, in the background or not
    (``hethub.runtime.saving``): what an elastic restart resumes from."""
    dir: Optional[str] = None
    every_steps: int = 0
    background: bool = True


@dataclass(frozen=True)
class StageParts:
    """What start-up built for this rank, handed to the engine whole (``hethub.runtime.startup``): the plan and
    the rank's place in it, its stage's module, the control channel, precision, tied weights, its action list
    (None: the plan's), ZeRO-1 (made from DeepSpeed's optimizer once it exists), the gradient buckets' size,
    autosave, an elastic run's heartbeat (rank 0), and an emulated device type (tests and benchmarks)."""
    plan: Any
    grid: HeteroGrid
    module: HeteroPipelineModule
    control: Control
    precision: Precision = field(default_factory=lambda: Precision("fp32", FP16Section()))
    ties: tuple = ()
    schedule: Optional[list] = None
    zero1: Optional[Callable] = None
    bucket_bytes: int = BUCKET_BYTES
    autosave: Autosave = Autosave()
    heartbeat: Any = None
    emulated: Any = None  # hethub.emulated.device.EmulatedDevice


class HeteroPipelineEngine(PipelineEngine):
    """Executes hethub's per-rank schedule under a hethub plan. DeepSpeed's own arguments (``config``,
    ``config_class``, ``optimizer``, ``model_parameters``, ``lr_scheduler``) go to ``DeepSpeedEngine``; the
    rest is start-up's ``StageParts``."""

    def __init__(self, parts: StageParts, *, config: dict, config_class, optimizer=None, model_parameters=None,
                 lr_scheduler=None):
        plan, grid, control = parts.plan, parts.grid, parts.control
        DeepSpeedEngine.__init__(self, args=None, model=parts.module, optimizer=optimizer,
                                 model_parameters=model_parameters, lr_scheduler=lr_scheduler, mpu=grid,
                                 config=config, config_class=config_class,
                                 # tensor-parallel (DTensor) parameters were placed before being split
                                 dont_change_device=grid.tp > 1)
        self.plan, self.grid, self.ties, self.control = plan, grid, tuple(parts.ties), control
        self.precision = parts.precision
        self.loss_scaler = self.precision.loss_scaler()  # fp16 only: DeepSpeed's dynamic (or static) scaler
        for name, value in ds_seams.pipeline_engine_attrs(grid, plan).items():
            setattr(self, name, value)
        self._global_batch = plan.global_batch_size
        self.autosave = parts.autosave
        self.saver = saving.Saver()  # this rank's checkpoint writes (one may be in flight, in the background)
        self.heartbeat = parts.heartbeat  # an elastic run's rank 0: its last step and time, for the next restart
        # This rank's training actions: the plan's schedule or a hand-edited one (checked before launch).
        self.schedule = list(parts.schedule) if parts.schedule is not None else build_schedule(plan)[grid.schedule_rank]
        self.guard = Guard(grid.global_rank, grid.stage_id, grid.world_size, lambda: self.global_steps)
        if self.device.type != "cpu" and any(not grid.on_host(g) for g in grid.my_groups()):
            # NCCL/RCCL report a lost peer only through their watchdog, at the groups' timeout, with a C++ trace:
            # hethub's own watchdog says it in one line a little before (errors.Guard.start_watchdog)
            self.guard.start_watchdog(max(0.9 * control.timeout_s, control.timeout_s - 15.0))
        self.zero1 = parts.zero1(self.optimizer) if parts.zero1 is not None else None
        self.transport = Transport(grid, self.device, self.guard, default_wire=self.precision.wire)
        self.gradients = Gradients(grid, parts.module, self.device, self.guard, control, self.zero1,
                                   parts.bucket_bytes)
        self.executor = Executor(grid, parts.module, self.transport, self.gradients, self.guard, device=self.device,
                                 micro_batch_size=plan.micro_batch_size, next_batch=self._next_batch,
                                 step=self._exec_optimizer_step, autocast_dtype=self.precision.autocast_dtype,
                                 emulated=parts.emulated)

    def checkpoint_parts(self) -> checkpoint.CheckpointParts:
        """What a checkpoint reads and writes of this engine, now (``hethub.runtime.checkpoint``)."""
        return checkpoint.CheckpointParts(
            plan=self.plan, grid=self.grid, control=self.control, module=self.module, optimizer=self.optimizer,
            counters=checkpoint.Counters(self.global_steps, self.global_samples, getattr(self, "skipped_steps", 0)),
            zero1=self.zero1, lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler, ties=self.ties,
            gradients=self.gradients)

    @property
    def executed(self) -> list[str]:
        """The actions of the last train_batch/eval_batch, as text, in order."""
        return self.executor.executed

    @property
    def executed_s(self) -> list[tuple[float, float, float]]:
        """(start, end, seconds waiting for data) of each executed action, perf_counter seconds."""
        return self.executor.executed_s

    def _broadcast_model(self):
        """DeepSpeed's start-up broadcast of the weights within the data-parallel group, on each rank's own
        tensors: with tensor parallelism a parameter is a DTensor, and the group is the ranks holding the
        same shard (called from DeepSpeedEngine.__init__, so it reads ``self.mpu``)."""
        broadcast_weights(self.mpu, list(self.module.parameters()))

    # ------------------------------------------------------------------ batches
    def train_batch(self, data_iter: Optional[Iterator] = None):
        """One iteration over the plan's global batch; returns the global mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.executor.loss_scale = self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0
        self.executor.run(self.schedule, loss_denominator=self._global_batch)
        self.agg_train_loss = self._aggregate_total_loss()
        # A checkpoint written in the background (from the end of the previous step) is completed here: it had this
        # step to be written, what is left of the write this step waits for, so one taken at step k is complete
        # once step k + 1 is, always (a restart loses at most the interval plus one step)
        if self.saver.pending is not None:
            self.saver.poll(self.checkpoint_parts(), wait=True)
        if self.autosave.every_steps and self.global_steps % self.autosave.every_steps == 0:
            self.saver.save(self.checkpoint_parts(), self.autosave.dir, background=self.autosave.background)
        if self.heartbeat is not None:
            self.heartbeat.beat(self.global_steps)
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
        actions = build_schedule(self.plan, train=False, num_micro_batches=micro_batches)[self.grid.schedule_rank]
        with torch.no_grad():
            self.executor.run(actions, loss_denominator=micro_batches * self.plan.micro_batch_size)
        self.agg_eval_loss = self._aggregate_total_loss()
        self.module.train()
        return self.agg_eval_loss

    def _aggregate_total_loss(self) -> torch.Tensor:
        self.total_loss = self.executor.total_loss
        return self.gradients.global_loss(self.total_loss)

    def set_dataiterator(self, iterator):
        if self.grid.holds_first or self.grid.holds_last:
            self.training_dataloader = None
            self.data_iterator = iterator

    # ------------------------------------------------------------------ the step
    def clip_fp32_gradients(self):
        self._global_grad_norm = self.gradients.clip(self.gradient_clipping())

    def _exec_optimizer_step(self, lr_kwargs=None):
        samples = self.global_samples
        self.gradients.step_sums(self.executor.total_loss, self.executor.loss_scale)
        if self.loss_scaler is not None:
            finite = self.gradients.unscale(self.executor.loss_scale)
            self.loss_scaler.update_scale(not finite)
            if not finite:  # every rank agreed: skip the step everywhere, as DeepSpeed's fp16 optimizer does
                self._skip_step(samples)
                return
        self._force_grad_boundary = True
        self._take_model_step(lr_kwargs)
        self._force_grad_boundary = False
        self.gradients.after_step()
        self.global_samples = samples + self._global_batch  # DeepSpeed counts this rank's share only

    def _skip_step(self, samples: int) -> None:
        """fp16 overflow: drop the gradients, count the step as taken and skipped, leave weights, optimizer state
        and learning-rate schedule as they were (DeepSpeed's accounting of an overflowed step)."""
        self.zero_grad()
        self._step_applied = False
        self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples = samples + self._global_batch

    def is_gradient_accumulation_boundary(self):
        return self._force_grad_boundary

    # ------------------------------------------------------------------ checkpoints (per layer: any plan loads them)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **_kw):
        """Collective. Per-layer files that any other plan of the same model can load (hethub.runtime.checkpoint);
        complete when it returns."""
        return self.saver.save(self.checkpoint_parts(), save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, **_kw):
        """Returns (checkpoint path, client_state) like DeepSpeed's engine."""
        self.saver.poll(self.checkpoint_parts(), wait=True)  # a checkpoint still being written is completed first
        tag, client, counters = checkpoint.load(self.checkpoint_parts(), load_dir, tag, load_optimizer_states)
        self.global_steps, self.global_samples = counters.global_steps, counters.global_samples
        self.skipped_steps = counters.skipped_steps
        return os.path.join(load_dir, tag), client

    # ------------------------------------------------------------------ DeepSpeed's batch keys, as DeepSpeed means them
    # While DeepSpeed's constructor runs (no plan yet) they give its own per-rank bookkeeping.
    def train_micro_batch_size_per_gpu(self) -> int:
        """The plan's micro-batch (each pipeline step's samples, however the plan splits them over a stage's
        replicas), as in a DeepSpeed pipeline; DeepSpeed's own accounting inside this rank uses its rows."""
        plan = self.__dict__.get("plan")
        return plan.micro_batch_size if plan is not None else super().train_micro_batch_size_per_gpu()

    def gradient_accumulation_steps(self) -> int:
        plan = self.__dict__.get("plan")
        return plan.num_micro_batches if plan is not None else super().gradient_accumulation_steps()

    def train_batch_size(self) -> int:
        plan = self.__dict__.get("plan")
        return plan.global_batch_size if plan is not None else super().train_batch_size()

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
        """Nothing to do: every activation send carries its shapes (``transport``), so a new sequence length
        needs no reset (DeepSpeed's pipeline engine needs this call after one)."""
