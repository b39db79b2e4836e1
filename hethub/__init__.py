"""hethub: train one model across a heterogeneous GPU fleet on DeepSpeed's pipeline engine.

The runtime (torch, deepspeed) is imported lazily so that ``import hethub.partitioner``
and ``hethub plan`` never pull torch in.
"""
import importlib

from . import _deepspeed_hook
from ._version import __version__

_deepspeed_hook.install()  # deepspeed.initialize with a "hetero" ds_config section builds hethub's engine

__all__ = ["__version__", "initialize", "add_config_arguments"]


def __getattr__(name):
    if name in ("initialize", "add_config_arguments"):
        # lazy: `import hethub` (the CLI, the planner) must not import torch and deepspeed
        return getattr(importlib.import_module(".runtime", __name__), name)
    raise AttributeError(f"module 'hethub' has no attribute {name!r}")
