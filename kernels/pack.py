"""pack/unpack of sample-row ranges: the one function pair every stage-boundary transfer goes through.

Why: when stage s (width a) hands a micro-batch to stage s+1 (width b), a replica sends several row
slices of one ``[batch, ...]`` tensor to several peers, possibly another vendor's device behind a
slow link. Packing the slices into one contiguous buffer — casting on the way — costs one pass over
memory; unpacking writes each slice at its offset with the up-cast.

Formats of the send buffer:
- lossless: ``[rows, *trailing]`` in the wire dtype (the input's, or bf16/fp16). Down-casts round to
  nearest even, exactly as ``tensor.to(dtype)``.
- fp8 (opt-in, lossy, ``dtype=torch.float8_e4m3fn``): ``uint8 [rows, T*H + 4*T]`` for an input
  ``[rows, ..., H]`` with T = product of the middle dims: per row, the T*H e4m3 codes, then T fp32
  scales (one per last-dim vector: scale = absmax / 448). Error bound per element, documented and
  tested: ``|x' - x| <= 2^-4 |x| + 2^-10 scale`` (half an e4m3 ulp, normal and subnormal range).

``pack``/``unpack`` pick the Triton kernels for CUDA/ROCm tensors when Triton imports (or when
``backend="triton"`` is asked for, e.g. under ``TRITON_INTERPRET=1`` on CPU), the plain-torch
reference otherwise; both give bit-identical results for the lossless casts.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import torch

from .layout import (FP8, FP8_MAX, WIRE_DTYPES, WIRE_NAMES, Range, check_pack, check_ranges, check_unpack,
                     fp8_shape, wire_dtype_for, wire_layout)

__all__ = ["FP8", "FP8_MAX", "WIRE_DTYPES", "WIRE_NAMES", "Range", "check_ranges", "wire_dtype_for", "wire_layout",
           "pack", "unpack", "pack_reference", "unpack_reference", "triton_available", "fp8_supported"]


def pack_reference(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rows ``x[a:b]`` for each range, concatenated in order, cast to the wire dtype."""
    total, wire = check_pack(x, ranges, dtype)
    rows = torch.cat([x[a:b] for a, b in ranges]) if ranges else x[:0]
    if wire != FP8:
        out = torch.empty((total, *x.shape[1:]), dtype=wire, device=x.device)
        out.copy_(rows)
        return out
    T, H = fp8_shape(x.shape)
    v = rows.float().reshape(total, T, H)
    amax = v.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (v / scale[..., None]).to(FP8)
    out = torch.empty((total, T * H + 4 * T), dtype=torch.uint8, device=x.device)
    out[:, :T * H] = q.reshape(total, T * H).view(torch.uint8)
    out[:, T * H:] = scale.contiguous().view(torch.uint8).reshape(total, 4 * T)
    return out


def unpack_reference(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    """Inverse of pack: write consecutive rows of ``buf`` into ``out[a:b]`` for each range (with up-cast)."""
    total = check_unpack(buf, out, ranges)
    if buf.dtype != torch.uint8:
        off = 0
        for a, b in ranges:
            out[a:b].copy_(buf[off:off + b - a])
            off += b - a
        return out
    T, H = fp8_shape(out.shape)
    q = buf[:, :T * H].contiguous().view(FP8).float().reshape(total, T, H)
    scale = buf[:, T * H:].contiguous().view(torch.float32).reshape(total, T)
    vals = (q * scale[..., None]).reshape(total, *out.shape[1:])
    off = 0
    for a, b in ranges:
        out[a:b].copy_(vals[off:off + b - a])
        off += b - a
    return out


def triton_available() -> bool:
    if os.environ.get("HETHUB_DISABLE_TRITON") == "1" or _BROKEN:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no Triton here"
        return False
    return True


_BROKEN: list[str] = []  # why the Triton kernels were given up for this process (empty: they run)


def fp8_supported(t: torch.Tensor) -> bool:
    """Whether the device compiles Triton's e4m3 (``float8e4nv``): NVIDIA from compute capability 8.9 (not A100
    or V100), AMD's gfx94x (MI300) and newer; a CPU tensor only under the interpreter."""
    if not t.is_cuda:
        return os.environ.get("TRITON_INTERPRET") == "1"
    if getattr(torch.version, "hip", None):
        arch = getattr(torch.cuda.get_device_properties(t.device), "gcnArchName", "")
        return arch.startswith(("gfx94", "gfx95", "gfx12"))
    return torch.cuda.get_device_capability(t.device) >= (8, 9)


def fp8_aligned(shape) -> bool:
    """Whether the compiled fp8 kernels may run on a tensor of ``shape``: each row's scales (float32) are stored
    after its T * H codes, at 4-byte alignment only where T * H is a multiple of 4 (a misaligned store is an
    asynchronous device fault no ``try`` catches). Other shapes use the reference, which writes bytes."""
    T, H = fp8_shape(tuple(shape))
    return (T * H) % 4 == 0


def _use_triton(t: torch.Tensor, backend: Optional[str], fp8: bool) -> bool:
    if fp8 and not fp8_aligned(t.shape):
        return False
    if backend == "reference":
        return False
    if backend == "triton":
        return True
    if backend is not None:
        raise ValueError(f"backend: expected 'triton', 'reference' or None, got {backend!r}")
    return t.is_cuda and triton_available() and (not fp8 or fp8_supported(t))


def _fall_back(exc: Exception) -> None:
    """A Triton compile or launch failure (no C compiler for its launcher, an unsupported type, a driver
    error): say so once, then use the reference for the rest of the process."""
    if not _BROKEN:
        _BROKEN.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}")
        sys.stderr.write(f"hethub: the Triton pack/unpack kernels failed ({_BROKEN[0]}); using the torch "
                         "reference from now on\n")


def pack(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None,
         backend: Optional[str] = None) -> torch.Tensor:
    if _use_triton(x, backend, dtype == FP8):
        from .triton_pack import pack_triton  # lazy: Triton is optional (the reference runs without it)
        try:
            return pack_triton(x, ranges, dtype)
        except ValueError:
            raise  # bad input (a range outside the tensor): the caller's error, not the kernel's
        except Exception as exc:  # noqa: BLE001 - any compile or launch failure: the reference is exact
            if backend == "triton":
                raise
            _fall_back(exc)
    return pack_reference(x, ranges, dtype)


def unpack(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range], backend: Optional[str] = None
           ) -> torch.Tensor:
    if _use_triton(out, backend, buf.dtype == torch.uint8):
        from .triton_pack import unpack_triton  # lazy: Triton is optional (the reference runs without it)
        try:
            return unpack_triton(buf, out, ranges)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - any compile or launch failure: the reference is exact
            if backend == "triton":
                raise
            _fall_back(exc)
    return unpack_reference(buf, out, ranges)
