"""``import hethub`` in a script run by plain ``deepspeed`` routes ``deepspeed.initialize`` to hethub where the
ds_config has a ``hetero`` section (``hethub.runtime.routing``), without importing torch or DeepSpeed itself.

Why a hook, and why this light: ``import hethub`` is also the planner's and the CLI's import, which must not pull
torch in; so the hook only waits for DeepSpeed to be imported (or finds it imported) and then replaces
``deepspeed.initialize`` by a wrapper that loads the routing on the first call.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _wrap(ds) -> None:
    """``ds.initialize`` replaced by one that installs the routing (which keeps DeepSpeed's own) and calls it."""
    own = ds.initialize
    if getattr(own, "hethub_routes", False):
        return

    def initialize(*args, **kwargs):
        ds.initialize = own  # the routing keeps DeepSpeed's own, not this wrapper
        routing = importlib.import_module("hethub.runtime.routing")
        routing.install()
        return ds.initialize(*args, **kwargs)
    initialize.hethub_routes = True
    initialize.__wrapped__ = own
    ds.initialize = initialize


class _AfterDeepSpeed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed`` as Python would, lets it load, then wraps its ``initialize``."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        _wrap(module)


def install() -> None:
    ds = sys.modules.get("deepspeed")
    if ds is not None and hasattr(ds, "initialize"):
        _wrap(ds)
    elif not any(isinstance(f, _AfterDeepSpeed) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDeepSpeed())
