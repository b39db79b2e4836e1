"""pack/unpack of sample-row ranges, the one function pair every boundary transfer goes through.

Why: when stage s (width a) hands a micro-batch to stage s+1 (width b), a replica sends several
row slices of one ``[batch, ...]`` tensor to several peers. Packing them into one contiguous
buffer (and casting on the way, for slow or cross-vendor links) costs one pass over memory.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

Range = tuple[int, int]


def check_ranges(rows: int, ranges: Sequence[Range], what: str = "ranges") -> int:
    """Validate half-open row ranges inside ``[0, rows)`` that do not overlap; return the total row count."""
    total = 0
    spans = []
    for k, (a, b) in enumerate(ranges):
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


def pack_reference(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rows ``x[a:b]`` for each range, concatenated in order, cast to ``dtype`` (default: x's dtype)."""
    total = check_ranges(x.shape[0], ranges)
    out = torch.empty((total, *x.shape[1:]), dtype=dtype or x.dtype, device=x.device)
    off = 0
    for a, b in ranges:
        out[off:off + b - a].copy_(x[a:b])
        off += b - a
    return out


def unpack_reference(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    """Inverse of pack: write consecutive rows of ``buf`` into ``out[a:b]`` for each range (with up-cast)."""
    total = check_ranges(out.shape[0], ranges)
    if buf.shape[0] != total or buf.shape[1:] != out.shape[1:]:
        raise ValueError(f"buf: shape {tuple(buf.shape)} does not match {total} rows of {tuple(out.shape[1:])}")
    off = 0
    for a, b in ranges:
        out[a:b].copy_(buf[off:off + b - a])
        off += b - a
    return out


def pack(x: torch.Tensor, ranges: Sequence[Range], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return pack_reference(x, ranges, dtype)


def unpack(buf: torch.Tensor, out: torch.Tensor, ranges: Sequence[Range]) -> torch.Tensor:
    return unpack_reference(buf, out, ranges)
