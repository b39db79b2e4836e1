"""Every DeepSpeed name hethub relies on that is not DeepSpeed's public API, checked at import.

hethub extends DeepSpeed at public seams where they exist (``DeepSpeedEngine`` and its config, the
``mpu`` protocol, ``deepspeed.init_distributed``, the launcher's runner). Where no seam exists it uses,
overrides or bypasses the names below; a DeepSpeed release that renames one would otherwise fail deep inside
training with an AttributeError, or silently skip hethub's override. ``check()`` runs when the engine is imported
and raises ``DeepSpeedSeamError`` (one line: the missing name and the supported range), which
``hethub.initialize`` turns into exit 2 before any collective.

Two constructors are bypassed: ``PipelineModule.__init__`` (it builds a dense grid and its own partition) and
``PipelineEngine.__init__`` (dense-grid asserts, batch arithmetic, a blocking one-to-one warm-up send). The
attributes they would have set, which DeepSpeed's engine then reads, are set from ``pipeline_module_attrs`` and
``pipeline_engine_attrs``; ``check()`` also confirms the bypassed constructor still sets each of them, so a
DeepSpeed that reads a new one is noticed here rather than as an AttributeError mid-step.
"""
from __future__ import annotations

import importlib
import inspect
import re

import deepspeed
from torch import nn

from ..partitioner.errors import InputError

SUPPORTED = "deepspeed>=0.19.0,<0.20"

# (module, attribute path, how hethub uses it)
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("deepspeed.runtime.engine", "DeepSpeedEngine._take_model_step",
     "called: the optimizer step (clipping, scheduler, counters) run at the schedule's OPT action"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._broadcast_model",
     "overridden: the start-up weight broadcast on each rank's own (tensor-parallel) shard"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.clip_fp32_gradients",
     "overridden: the global norm over stages of unequal width"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._next_batch",
     "called: reads the next micro-batch from the user's data iterator"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_optimizer_step",
     "overridden: the step at the OPT action, with hethub's batch accounting"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._aggregate_total_loss",
     "overridden: the global mean loss over stages of unequal width"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine.__init__",
     "bypassed: dense-grid asserts and a blocking warm-up send; pipeline_engine_attrs stands in for it"),
    ("deepspeed.runtime.pipe.module", "PipelineModule.__init__",
     "bypassed: a dense grid and its own partition; pipeline_module_attrs stands in for it"),
    ("deepspeed", "initialize", "routed under a plan (hethub.runtime.routing): returns hethub's engine"),
    ("deepspeed", "init_distributed", "routed under a plan: the world hethub's plan needs (routing)"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.__init__",
     "guarded under a plan: any engine but hethub's is refused (routing)"),
    ("deepspeed.runtime.dataloader", "RepeatingLoader", "built: training_data= read in passes (frontdoor)"),
    ("deepspeed.comm.torch", "build_shm_op",
     "replaced on CPU: a ~40 s JIT build of a shared-memory op pipeline training never uses"),
    ("deepspeed.launcher.runner", "parse_args", "called: hethub launch splits DeepSpeed's flags from the script"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler.update_scale",
     "called: fp16's loss-scale policy after hethub's own overflow check (its state saved by name in checkpoints)"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "built: a static fp16 loss scale (ds_config loss_scale > 0)"),
)

# Attributes DeepSpeed reads that the bypassed constructors would set but do not (set elsewhere in DeepSpeed).
_SET_ELSEWHERE = {"agg_eval_loss", "checkpoint_parallel_write_pipeline"}


def pipeline_engine_attrs(grid, plan) -> dict:
    """What ``PipelineEngine.__init__`` would set and DeepSpeed's engine reads, for this rank of ``plan``."""
    return {
        "enable_backward_allreduce": False,  # gradients are reduced at the schedule's AR action
        "pipeline_enable_backward_allreduce": True, "has_bool_tensors": False, "eval_return_logits": False,
        "outputs": None, "using_bf16_optimizer": False, "log_batch_step_id": -1,
        "micro_batch_size": grid.sample_stop - grid.sample_start,  # this replica's rows
        "micro_batches": plan.num_micro_batches, "global_rank": grid.global_rank,
        "num_stages": grid.pipe_parallel_size, "stage_id": grid.stage_id,
        "prev_stage": grid.stage_id - 1, "next_stage": grid.stage_id + 1,
        "data_iterator": None, "batch_fn": None, "_force_grad_boundary": False,
        "is_pipe_parallel": grid.pipe_parallel_size > 1, "is_data_parallel": grid.data_parallel_size > 1,
        "is_model_parallel": False, "is_pipe_partitioned": False, "is_grad_partitioned": False,
        "total_loss": None, "agg_train_loss": None, "agg_eval_loss": None, "dynamic_shape": False,
    }


def pipeline_module_attrs(grid) -> dict:
    """What ``PipelineModule.__init__`` would set beyond the layers, for this rank's stage."""
    return {"_topo": None, "num_stages": grid.pipe_parallel_size, "stage_id": grid.stage_id,
            "global_rank": grid.global_rank, "micro_offset": 0, "tied_modules": nn.ModuleDict(),
            "tied_weight_attrs": {}, "tied_comms": {}, "activation_checkpoint_interval": 0,
            "activation_checkpoint_func": None, "checkpointable_layers": None, "dynamic_shape": False,
            "checkpoint_parallel_write_pipeline": False}


class DeepSpeedSeamError(InputError):
    """The installed DeepSpeed lacks a name hethub relies on."""


def _resolve(module: str, path: str) -> object:
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _assigned(constructor, names) -> list[str]:
    """Of ``names``, those the constructor's source no longer assigns (none where the source is unreadable)."""
    try:
        src = inspect.getsource(inspect.unwrap(constructor))  # DeepSpeed's own, where routing replaced it
    except (OSError, TypeError):
        return []
    return [n for n in names if n not in _SET_ELSEWHERE and not re.search(rf"self\.{re.escape(n)}\s*=", src)]


def check() -> None:
    """Raise DeepSpeedSeamError naming the first missing name or the first stubbed attribute DeepSpeed dropped."""
    version = getattr(deepspeed, "__version__", "?")
    for module, path, why in PRIVATE_NAMES:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            raise DeepSpeedSeamError("deepspeed", f"{module}.{path} is missing in DeepSpeed {version} (hethub uses "
                                                  f"it: {why}); supported: {SUPPORTED}") from None
    fake = _FakeGrid()
    for path, names in (("PipelineEngine.__init__", pipeline_engine_attrs(fake, fake)),
                        ("PipelineModule.__init__", pipeline_module_attrs(fake))):
        module = "deepspeed.runtime.pipe." + ("engine" if path.startswith("PipelineEngine") else "module")
        gone = _assigned(_resolve(module, path), names)
        if gone:
            raise DeepSpeedSeamError("deepspeed", f"{module}.{path} in DeepSpeed {version} no longer sets "
                                                  f"{', '.join(gone)} (hethub stands in for that constructor); "
                                                  f"supported: {SUPPORTED}")


class _FakeGrid:
    """Just enough of a grid and a plan to list the stubbed attributes' names."""
    sample_start, sample_stop, num_micro_batches, global_rank = 0, 1, 1, 0
    pipe_parallel_size, data_parallel_size, stage_id = 1, 1, 0
