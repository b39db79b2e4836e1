"""Measured blocks that differ only by measurement noise, priced alike for the search.

Why: the shape MILP plans a model of identical blocks at layer granularity, where a stage's cost depends only on
how many blocks it holds; it is what proves plans on 100-300 devices within a minute. Measured profiles never
give identical blocks (OPT-350M's blocks on A100 and V100, 3% apart by noise: the chain MILP over 26 layers
ended 23.5% from its bound after 30 s, with a plan 12% slower than a Metis-shaped one). Where every block's
measured times lie within ``BLOCK_NOISE`` of the blocks' mean, the search prices each block at that mean; the
plans it returns are then replayed, and chosen, with the times as measured.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from ..costmodel import CostModel
from ..records import Profile

BLOCK_NOISE = 0.10  # (max - min) / mean of a block time across the blocks, per profile and field
_TIMES = ("forward_ms", "backward_ms", "input_grad_ms", "weight_grad_ms")
_BYTES = ("activation_bytes", "peak_memory_bytes")


def _spread(values: list[float]) -> float:
    v = np.asarray(values, dtype=float)
    return float(np.ptp(v) / v.mean()) if len(v) and v.mean() > 0 else 0.0


def _averaged(p: Profile, blocks: set[int]) -> tuple[Profile, float]:
    """The profile with every block layer's fields at the blocks' mean, and the largest spread it evened out
    (past BLOCK_NOISE: returned unchanged, with that spread)."""
    mine = [lp for lp in p.layers if lp.index in blocks]
    worst, means = 0.0, {}
    for name in (*_TIMES, *_BYTES):
        values = [getattr(lp, name) for lp in mine]
        if not values or any(v is None for v in values):
            continue
        worst = max(worst, _spread(values))
        means[name] = float(np.mean(values)) if name in _TIMES else int(round(np.mean(values)))
    if worst > BLOCK_NOISE or not means:
        return p, worst
    layers = [lp.model_copy(update=means) if lp.index in blocks else lp for lp in p.layers]
    return p.model_copy(update={"layers": layers}), worst


def block_averaged(cm: CostModel) -> Optional[tuple[CostModel, float]]:
    """A cost model whose profiles price every block at the blocks' mean, and the largest spread averaged away;
    None where there is nothing to average (no profiles) or a block differs by more than noise."""
    if not cm.profiles:
        return None
    blocks = {li.index for li in cm.model.layers() if li.kind == "block"}
    if len(blocks) < 2:
        return None
    out, worst = [], 0.0
    for p in cm.profiles:
        q, spread = _averaged(p, blocks)
        if spread > BLOCK_NOISE:
            return None
        out.append(q)
        worst = max(worst, spread)
    if worst == 0.0:
        return None  # already identical
    return replace(cm, profiles=tuple(out), notes=[]), worst
