"""Every Python the tests start (conftest puts this folder first on ``PYTHONPATH``) skips DeepSpeed's CPU
shared-memory op, as hethub's own world start does (``hethub.runtime.startup``).

Why: ``deepspeed.comm``'s CPU backend JIT-compiles that op (two C++ files, ~70 s of both cores) in every new
environment, for an all-reduce only DeepSpeed's inference uses; the tests' plain-DeepSpeed runs (the unchanged
scripts and their references) waited on its build lock, and a machine without a C++ compiler could not run them.
Training is untouched: the pipeline engine's collectives never reach that op.

Any other ``sitecustomize`` further along the path is run after this one, so the tests' children keep it.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_TARGET = "deepspeed.comm.torch"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _skip(module) -> None:
    module.build_shm_op = lambda: None


class _SkipOnImport(importlib.abc.MetaPathFinder):
    """Once: finds ``deepspeed.comm.torch`` as Python would, its loader set to skip the op after running it."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module
            spec.loader.exec_module = lambda module: (run(module), _skip(module))
        return spec


def _run_the_next_sitecustomize() -> None:
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if _TARGET in sys.modules:
    _skip(sys.modules[_TARGET])
else:
    sys.meta_path.insert(0, _SkipOnImport())
_run_the_next_sitecustomize()
