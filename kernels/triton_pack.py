"""Triton kernels behind ``pack``/``unpack`` (see kernels/pack.py for formats and error bounds).

One launch per contiguous row range (a transfer's rows), one program per (row, column block) flattened on the
grid's first axis (its second is capped at 65,535 on CUDA: 8192 x 8192 rows would not launch): it reads its
source row at the range's offset, casts, and writes — one pass over memory, and nothing copied from the host
(a row map built on the host was a synchronous host-to-device copy that stalled every pack). Down-casts to bf16
round to nearest even with integer bit
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


# Row offsets change with every transfer (a replica's first row, a peer's slice): specialised, as Triton does for
# integer arguments equal to 1 or divisible by 16, they would compile a kernel per class of offset in the first
# iteration; not specialised, one compile serves every offset.
@triton.jit(do_not_specialize=["src_row0", "dst_row0"])
def _copy_rows(src, dst, src_row0, dst_row0, D, NCB, OUT_ID: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    r = pid // NCB
    cols = (pid % NCB) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    v = tl.load(src + (src_row0 + r) * D + cols, mask=mask)
    tl.store(dst + (dst_row0 + r) * D + cols, _cast(v, OUT_ID), mask=mask)


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


@triton.jit(do_not_specialize=["src_row0", "dst_row0"])
def _pack_fp8(src, dst, src_row0, dst_row0, T, H, ROW_BYTES, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    r, t = pid // T, pid % T
    s = src_row0 + r
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    v = tl.load(src + (s * T + t) * H + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=0)
    # IEEE division (Triton's fp32 "/" is approximate on GPUs): the same scale and codes as the reference
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = _round_e4m3(tl.math.div_rn(v, scale)).to(tl.float8e4nv)
    row = dst + (dst_row0 + r) * ROW_BYTES
    tl.store(row.to(tl.pointer_type(tl.float8e4nv)) + t * H + cols, q, mask=mask)
    tl.store((row + T * H).to(tl.pointer_type(tl.float32)) + t, scale)


@triton.jit(do_not_specialize=["src_row0", "dst_row0"])
def _unpack_fp8(src, dst, src_row0, dst_row0, T, H, ROW_BYTES, OUT_ID: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    r, t = pid // T, pid % T
    d = dst_row0 + r
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    row = src + (src_row0 + r) * ROW_BYTES
    q = tl.load(row.to(tl.pointer_type(tl.float8e4nv)) + t * H + cols, mask=mask).to(tl.float32)
    scale = tl.load((row + T * H).to(tl.pointer_type(tl.float32)) + t)
    tl.store(dst + (d * T + t) * H + cols, _cast(q * scale, OUT_ID), mask=mask)


def _pieces(ranges: Sequence[Range]) -> list[tuple[int, int, int]]:
    """(row in the tensor, row in the buffer, rows) of each non-empty range: the buffer holds them in order."""
    out, off = [], 0
    for a, b in ranges:
        if b > a:
            out.append((a, off, b - a))
        off += b - a
    return out


def _warps(block_h: int) -> int:
    """Warps for an fp8 program over a vector of ``block_h`` values: about 32 values per thread, no spills."""
    return max(4, min(16, block_h // 256))


def pack_triton(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    total, wire = check_pack(x, ranges, dtype)
    x = x.contiguous()  # non-contiguous input: one extra copy, then the same kernel
    if wire != FP8:
        out = torch.empty((total, *x.shape[1:]), dtype=wire, device=x.device)
        D = x[0].numel() if x.shape[0] else 0
        if D:
            ncb = triton.cdiv(D, BLOCK)
            for row, off, n in _pieces(ranges):
                _copy_rows[(n * ncb,)](x, out, row, off, D, ncb, OUT_ID=_ID[wire], BLOCK=BLOCK)
        return out
    T, H = fp8_shape(x.shape)
    row_bytes = T * H + 4 * T
    out = torch.empty((total, row_bytes), dtype=torch.uint8, device=x.device)
    if T and H:
        block_h = triton.next_power_of_2(H)
        for row, off, n in _pieces(ranges):
            _pack_fp8[(n * T,)](x, out, row, off, T, H, row_bytes, BLOCK_H=block_h, num_warps=_warps(block_h))
    return out


def unpack_triton(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    check_unpack(buf, out, ranges)
    if not out.is_contiguous():
        tmp = unpack_triton(buf, out.contiguous(), ranges)
        out.copy_(tmp)
        return out
    buf = buf.contiguous()
    if buf.dtype != torch.uint8:
        D = out[0].numel() if out.shape[0] else 0
        if D:
            ncb = triton.cdiv(D, BLOCK)
            for row, off, n in _pieces(ranges):
                _copy_rows[(n * ncb,)](buf, out, off, row, D, ncb, OUT_ID=_ID[out.dtype], BLOCK=BLOCK)
        return out
    T, H = fp8_shape(out.shape)
    if T and H:
        block_h = triton.next_power_of_2(H)
        for row, off, n in _pieces(ranges):
            _unpack_fp8[(n * T,)](buf, out, off, row, T, H, T * H + 4 * T, OUT_ID=_ID[out.dtype], BLOCK_H=block_h,
                                  num_warps=_warps(block_h))
    return out
