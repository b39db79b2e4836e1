"""Every DeepSpeed name hethub relies on that is not DeepSpeed's public API, checked at import.

hethub extends DeepSpeed at public seams where they exist (``DeepSpeedEngine`` and its config, the
``mpu`` protocol, ``deepspeed.init_distributed``, the launcher's runner). Where no seam exists it uses
the names below; a DeepSpeed release that renames one would otherwise fail deep inside training
with an AttributeError. ``check()`` runs when ``hethub.engine`` is imported and raises
``DeepSpeedSeamError`` (one line: the missing name and the supported range), which
``hethub.initialize`` turns into exit 2 before any collective.
"""
from __future__ import annotations

import importlib

from ..partitioner.errors import InputError

SUPPORTED = "deepspeed>=0.19.0,<0.20"

# (module, attribute path, why hethub needs it)
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("deepspeed.runtime.engine", "DeepSpeedEngine._take_model_step",
     "the optimizer step (clipping, scheduler, counters) run at the schedule's OPT action"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._broadcast_model",
     "overridden: the start-up weight broadcast on each rank's own (tensor-parallel) shard"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.clip_fp32_gradients",
     "overridden: the global norm over stages of unequal width"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._next_batch",
     "reads the next micro-batch from the user's data iterator"),
    ("deepspeed.runtime.pipe.module", "PipelineModule",
     "HeteroPipelineModule subclasses it without running its __init__ (dense grid, own partition)"),
    ("deepspeed.comm.torch", "build_shm_op",
     "replaced on CPU: a ~40 s JIT build of a shared-memory op pipeline training never uses"),
    ("deepspeed.launcher.runner", "parse_args", "hethub launch splits DeepSpeed's flags from the script"),
)


class DeepSpeedSeamError(InputError):
    """The installed DeepSpeed lacks a name hethub relies on."""


def _resolve(module: str, path: str) -> object:
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check() -> None:
    """Raise DeepSpeedSeamError naming the first missing name."""
    import deepspeed
    version = getattr(deepspeed, "__version__", "?")
    for module, path, why in PRIVATE_NAMES:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            raise DeepSpeedSeamError("deepspeed", f"{module}.{path} is missing in DeepSpeed {version} (hethub uses "
                                                  f"it: {why}); supported: {SUPPORTED}") from None
