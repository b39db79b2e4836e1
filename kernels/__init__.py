"""Kernels for tensors that cross stage boundaries: pack row ranges (with an optional cast) into one
send buffer, and unpack them at their offsets. ``pack``/``unpack`` dispatch: a Triton kernel for
CUDA/ROCm tensors when Triton imports, the plain-torch reference otherwise. Tensors of other dtypes
(integers, float64) are not packed: they travel as they are.

This directory installs as ``hethub.kernels``. Imported as the top-level ``kernels`` it is only because the
repository root is on ``sys.path`` (``python -m`` or a PEP 517 build run from a checkout); that name belongs
to Hugging Face's ``kernels`` (a dependency of transformers >= 5.25, whose setuptools entry point every build
in its environment loads), so the module hands the name to the first other ``kernels`` on the path, or
reports it missing as Python would."""
if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    _path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this runs
    _spec.loader.exec_module(_module)
else:
    from .pack import WIRE_DTYPES, pack, pack_reference, unpack, unpack_reference, wire_dtype_for, wire_layout

    __all__ = ["WIRE_DTYPES", "pack", "unpack", "pack_reference", "unpack_reference", "wire_dtype_for",
               "wire_layout"]
