"""The layout of a boundary send buffer, shared by the plain-torch reference (``pack``) and the Triton kernels
(``triton_pack``): wire dtypes, the fp8 row format, and the checks both run before touching memory.

Why a module of its own: both implementations must agree on every byte, and neither should import the other
(the reference must load where Triton does not).
"""
from __future__ import annotations

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


def check_pack(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype]) -> tuple[int, torch.dtype]:
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


def fp8_shape(shape: torch.Size) -> tuple[int, int]:
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
        T, H = fp8_shape(torch.Size((1, *trailing)))
        return torch.uint8, (T * H + 4 * T,)
    return (wire or dtype), tuple(trailing)


# ---------------------------------------------------------------- reference


def check_unpack(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range]) -> int:
    if out.dtype not in WIRE_DTYPES:
        raise ValueError(f"out: dtype {out.dtype} cannot receive (expected float32, bfloat16 or float16)")
    total = check_ranges(out.shape[0], ranges)
    if buf.dtype == torch.uint8:
        T, H = fp8_shape(out.shape)
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
