"""hethub: train one model across a heterogeneous GPU fleet on DeepSpeed's pipeline engine.

The runtime (torch, deepspeed) is imported lazily so that ``import hethub.partitioner``
and ``hethub plan`` never pull torch in.
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("initialize", "add_config_arguments"):
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'hethub' has no attribute {name!r}")
