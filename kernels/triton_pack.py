"""Triton kernels behind ``pack``/``unpack`` (see kernels/pack.py for formats and error bounds).

One program per (output row, column block): it reads its source row through a small row map, casts,
and writes — one pass over memory. Down-casts to bf16 round to nearest even with integer bit
operations (the Triton interpreter's ``.to(tl.bfloat16)`` truncates; the bit version matches torch
everywhere); fp8 values are rounded to the e4m3 grid in fp32 arithmetic first, so the final cast
is exact whatever rounding mode the backend's cast uses.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .layout import FP8, Range, check_pack, check_unpack, fp8_shape

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCK = 1024


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest-even bf16 value, still as fp32 (so the cast after it is exact)."""
    bits = x.to(tl.uint32, bitcast=True)
    bias = ((bits >> 16) & 1) + 0x7FFF
    rounded = ((bits + bias) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)  # NaN stays NaN


@triton.jit
def _cast(x, OUT_ID: tl.constexpr):
    if OUT_ID == 1:
        return _round_bf16(x.to(tl.float32)).to(tl.bfloat16)
    elif OUT_ID == 2:
        return x.to(tl.float32).to(tl.float16)
    else:
        return x.to(tl.float32)


@triton.jit
def _copy_rows(src, dst, src_rows, dst_rows, D, OUT_ID: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    s = tl.load(src_rows + r).to(tl.int64)
    d = tl.load(dst_rows + r).to(tl.int64)
    v = tl.load(src + s * D + cols, mask=mask)
    tl.store(dst + d * D + cols, _cast(v, OUT_ID), mask=mask)


@triton.jit
def _round_e4m3(v):
    """|v| <= 448 in fp32 -> nearest-even e4m3 value (normal: 3 mantissa bits; subnormal: 2^-9 steps)."""
    a = tl.abs(v)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.maximum(e, -6)  # below 2^-6 the grid is the subnormal one, 2^-9
    quantum = ((e - 3 + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: (y + magic) - magic rounds y to an integer, nearest even
    q = ((a / quantum + magic) - magic) * quantum
    q = tl.minimum(q, 448.0)
    return tl.where(v < 0, -q, q)


@triton.jit
def _pack_fp8(src, dst, src_rows, T, H, ROW_BYTES, BLOCK_H: tl.constexpr):
    r = tl.program_id(0)
    t = tl.program_id(1)
    s = tl.load(src_rows + r).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    v = tl.load(src + (s * T + t) * H + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = _round_e4m3(v / scale).to(tl.float8e4nv)
    row = dst + r.to(tl.int64) * ROW_BYTES
    tl.store(row.to(tl.pointer_type(tl.float8e4nv)) + t * H + cols, q, mask=mask)
    tl.store((row + T * H).to(tl.pointer_type(tl.float32)) + t, scale)


@triton.jit
def _unpack_fp8(src, dst, dst_rows, T, H, ROW_BYTES, OUT_ID: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0)
    t = tl.program_id(1)
    d = tl.load(dst_rows + r).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    row = src + r.to(tl.int64) * ROW_BYTES
    q = tl.load(row.to(tl.pointer_type(tl.float8e4nv)) + t * H + cols, mask=mask).to(tl.float32)
    scale = tl.load((row + T * H).to(tl.pointer_type(tl.float32)) + t)
    tl.store(dst + (d * T + t) * H + cols, _cast(q * scale, OUT_ID), mask=mask)


def _row_map(ranges: Sequence[Range], device) -> torch.Tensor:
    idx = [r for a, b in ranges for r in range(a, b)]
    return torch.tensor(idx, dtype=torch.int64, device=device)


def pack_triton(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    total, wire = check_pack(x, ranges, dtype)
    x = x.contiguous()  # non-contiguous input: one extra copy, then the same kernel
    src_rows = _row_map(ranges, x.device)
    dst_rows = torch.arange(total, dtype=torch.int64, device=x.device)
    if wire != FP8:
        out = torch.empty((total, *x.shape[1:]), dtype=wire, device=x.device)
        D = x[0].numel() if x.shape[0] else out[0].numel() if total else 0
        if total and D:
            _copy_rows[(total, triton.cdiv(D, BLOCK))](x, out, src_rows, dst_rows, D, OUT_ID=_ID[wire], BLOCK=BLOCK)
        return out
    T, H = fp8_shape(x.shape)
    row_bytes = T * H + 4 * T
    out = torch.empty((total, row_bytes), dtype=torch.uint8, device=x.device)
    if total and T and H:
        _pack_fp8[(total, T)](x, out, src_rows, T, H, row_bytes, BLOCK_H=triton.next_power_of_2(H))
    return out


def unpack_triton(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    total = check_unpack(buf, out, ranges)
    if not out.is_contiguous():
        tmp = unpack_triton(buf, out.contiguous(), ranges)
        out.copy_(tmp)
        return out
    dst_rows = _row_map(ranges, out.device)
    src_rows = torch.arange(total, dtype=torch.int64, device=out.device)
    if buf.dtype != torch.uint8:
        D = out[0].numel() if out.shape[0] else 0
        buf = buf.contiguous()
        if total and D:
            _copy_rows[(total, triton.cdiv(D, BLOCK))](buf, out, src_rows, dst_rows, D, OUT_ID=_ID[out.dtype],
                                                      BLOCK=BLOCK)
        return out
    T, H = fp8_shape(out.shape)
    if total and T and H:
        _unpack_fp8[(total, T)](buf.contiguous(), out, dst_rows, T, H, T * H + 4 * T, OUT_ID=_ID[out.dtype],
                                BLOCK_H=triton.next_power_of_2(H))
    return out
