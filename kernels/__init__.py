"""Kernels for tensors that cross stage boundaries: pack row ranges (with an optional cast) into one
send buffer, and unpack them at their offsets. ``pack``/``unpack`` dispatch: a Triton kernel for
CUDA/ROCm tensors when Triton imports, the plain-torch reference otherwise. Tensors of other dtypes
(integers, float64) are not packed: they travel as they are."""
from .pack import WIRE_DTYPES, pack, pack_reference, unpack, unpack_reference, wire_dtype_for, wire_layout

__all__ = ["WIRE_DTYPES", "pack", "unpack", "pack_reference", "unpack_reference", "wire_dtype_for", "wire_layout"]
