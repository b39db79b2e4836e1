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
from typing import Optional, Sequence

import torch

Range = tuple[int, int]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_ranges(rows: int, ranges: Sequence[Range], what: str = "ranges") -> int:
    """Validate half-open row ranges inside ``[0, rows)`` that do not overlap; return the total row count."""
    total = 0
    spans = []
    for k, r in enumerate(ranges):
        a, b = int(r[0]), int(r[1])
        if not (0 <= a <= b <= rows):
            raise ValueError(f"{what}[{k}]: [{a}, {b}) is outside the tensor's rows [0, {rows})")
        total += b - a
        if b > a:
            spans.append((a, b, k))
    spans.sort()
    for (a0, b0, k0), (a1, b1, k1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise ValueError(f"{what}[{k1}]: [{a1}, {b1}) overlaps {what}[{k0}] [{a0}, {b0})")
    return total


def _check_pack(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype]) -> tuple[int, torch.dtype]:
    if x.dim() < 1:
        raise ValueError("x: expected a [batch, ...] tensor, got a scalar")
    if x.dtype not in WIRE_DTYPES:
        raise ValueError(f"x: dtype {x.dtype} cannot be packed (expected float32, bfloat16 or float16)")
    wire = dtype or x.dtype
    if wire not in WIRE_DTYPES + (FP8,):
        raise ValueError(f"dtype: {wire} is not a wire dtype (float32, bfloat16, float16, float8_e4m3fn)")
    if wire == torch.float32 and x.dtype != torch.float32:
        raise ValueError(f"dtype: packing {x.dtype} as float32 would only widen the message")
    if wire == FP8 and x.dim() < 2:
        raise ValueError("x: fp8 packing needs a [batch, ..., hidden] tensor (one scale per hidden vector)")
    return check_ranges(x.shape[0], ranges), wire


def _fp8_shape(shape: torch.Size) -> tuple[int, int]:
    """(T, H) of a [rows, ..., H] tensor: T hidden vectors of length H per row."""
    H = shape[-1]
    T = 1
    for d in shape[1:-1]:
        T *= d
    return T, H


WIRE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}


def wire_dtype_for(dtype: torch.dtype, wire: Optional[str]) -> Optional[torch.dtype]:
    """The dtype ``pack`` should cast a tensor of ``dtype`` to on a boundary whose wire dtype is ``wire``
    (None: send as is; never widen)."""
    if wire is None or dtype not in WIRE_DTYPES:
        return None
    w = WIRE_NAMES[wire]
    if w == torch.float32 or w == dtype:
        return None
    return w


def wire_layout(dtype: torch.dtype, trailing: Sequence[int], wire: Optional[torch.dtype]
                ) -> tuple[torch.dtype, tuple[int, ...]]:
    """(buffer dtype, per-row shape) of the packed rows of a ``[rows, *trailing]`` tensor."""
    if wire == FP8:
        T, H = _fp8_shape(torch.Size((1, *trailing)))
        return torch.uint8, (T * H + 4 * T,)
    return (wire or dtype), tuple(trailing)


# ---------------------------------------------------------------- reference


def pack_reference(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rows ``x[a:b]`` for each range, concatenated in order, cast to the wire dtype."""
    total, wire = _check_pack(x, ranges, dtype)
    rows = torch.cat([x[a:b] for a, b in ranges]) if ranges else x[:0]
    if wire != FP8:
        out = torch.empty((total, *x.shape[1:]), dtype=wire, device=x.device)
        out.copy_(rows)
        return out
    T, H = _fp8_shape(x.shape)
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
    total = _check_unpack(buf, out, ranges)
    if buf.dtype != torch.uint8:
        off = 0
        for a, b in ranges:
            out[a:b].copy_(buf[off:off + b - a])
            off += b - a
        return out
    T, H = _fp8_shape(out.shape)
    q = buf[:, :T * H].contiguous().view(FP8).float().reshape(total, T, H)
    scale = buf[:, T * H:].contiguous().view(torch.float32).reshape(total, T)
    vals = (q * scale[..., None]).reshape(total, *out.shape[1:])
    off = 0
    for a, b in ranges:
        out[a:b].copy_(vals[off:off + b - a])
        off += b - a
    return out


def _check_unpack(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range]) -> int:
    if out.dtype not in WIRE_DTYPES:
        raise ValueError(f"out: dtype {out.dtype} cannot receive (expected float32, bfloat16 or float16)")
    total = check_ranges(out.shape[0], ranges)
    if buf.dtype == torch.uint8:
        T, H = _fp8_shape(out.shape)
        want = (total, T * H + 4 * T)
    elif buf.dtype in WIRE_DTYPES:
        want = (total, *out.shape[1:])
    else:
        raise ValueError(f"buf: dtype {buf.dtype} is not a wire dtype")
    if tuple(buf.shape) != tuple(want):
        raise ValueError(f"buf: shape {tuple(buf.shape)} does not match {total} rows for out {tuple(out.shape)} "
                         f"(expected {want})")
    return total


# ---------------------------------------------------------------- dispatch


def triton_available() -> bool:
    if os.environ.get("HETHUB_DISABLE_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no Triton here"
        return False
    return True


def _use_triton(t: torch.Tensor, backend: Optional[str]) -> bool:
    if backend == "reference":
        return False
    if backend == "triton":
        return True
    if backend is not None:
        raise ValueError(f"backend: expected 'triton', 'reference' or None, got {backend!r}")
    return t.is_cuda and triton_available()


def pack(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None,
         backend: Optional[str] = None) -> torch.Tensor:
    if _use_triton(x, backend):
        from .triton_pack import pack_triton
        return pack_triton(x, ranges, dtype)
    return pack_reference(x, ranges, dtype)


def unpack(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range], backend: Optional[str] = None
           ) -> torch.Tensor:
    if _use_triton(out, backend):
        from .triton_pack import unpack_triton
        return unpack_triton(buf, out, ranges)
    return unpack_reference(buf, out, ranges)
