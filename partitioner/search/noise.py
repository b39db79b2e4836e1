"""Measured blocks that differ only by measurement noise, priced alike for the search.

Why: the shape MILP plans a model of identical blocks at layer granularity, where a stage's cost depends only on
how many blocks it holds; it is what proves plans on 100-300 devices within a minute. Measured profiles never
give identical blocks (OPT-350M's blocks on A100 and V100, 3% apart by noise: the chain MILP over 26 layers
ended 23.5% from its bound after 30 s, with a plan 12% slower than a Metis-shaped one). Where every block's
measured times lie within ``BLOCK_NOISE`` of the blocks' mean, the search prices each block at that mean; the
plans it returns are then replayed, and chosen, with the times as measured. The first and the last block may stand
apart by any amount: what they differ by is priced with the embedding and the head beside them, so the search
stays exact for every plan whose end stages hold them (an end stage that holds the embedding or head alone is
then priced with the difference that belongs to its neighbour).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import numpy as np

from ..costmodel import CostModel
from ..records import LayerProfile, Profile

BLOCK_NOISE = 0.10  # (max - min) / mean of a block time across the blocks, per profile and field
_TIMES = ("forward_ms", "backward_ms", "input_grad_ms", "weight_grad_ms")
_BYTES = ("activation_bytes", "peak_memory_bytes")


def _spread(values: list[float]) -> float:
    v = np.asarray(values, dtype=float)
    return float(np.ptp(v) / v.mean()) if len(v) and v.mean() > 0 else 0.0


def _interior(p: Profile, blocks: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The blocks whose spread must be noise, and the edge blocks folded onto a neighbour: (block, neighbour) for
    the first block beside the embedding and the last beside the head, where the profile measured that neighbour
    and at least two blocks lie between them."""
    measured = {lp.index for lp in p.layers}
    order = [i for i in blocks if i in measured]
    if len(order) < 4:
        return order, []
    edges = [(e, nb) for e, nb in ((order[0], order[0] - 1), (order[-1], order[-1] + 1)) if nb in measured]
    folded = {e for e, _ in edges}
    return [i for i in order if i not in folded], edges


def _folded(nb: LayerProfile, edge: LayerProfile, means: dict) -> LayerProfile:
    """The neighbour with what the edge block's times and activation bytes are over the blocks' mean added
    (never to 0 or below: a difference that would is left out, the edge then within noise of the mean)."""
    update = {}
    for name in (*_TIMES, "activation_bytes"):
        mine, theirs = getattr(nb, name), getattr(edge, name)
        if name in means and mine is not None and theirs is not None and mine + theirs - means[name] > 0:
            update[name] = mine + theirs - means[name]
    if nb.peak_memory_bytes is not None and edge.peak_memory_bytes is not None:
        update["peak_memory_bytes"] = max(nb.peak_memory_bytes, edge.peak_memory_bytes)
    return nb.model_copy(update=update)


def _averaged(p: Profile, blocks: list[int]) -> tuple[Profile, float, int]:
    """The profile with every block layer's fields at the interior blocks' mean, the first and last blocks'
    difference from it counted with the embedding and the head beside them (what is then exact for every plan
    whose first stage holds the first block, and whose last stage holds the last); the largest spread among the
    interior blocks it evened out (past BLOCK_NOISE: returned unchanged, with that spread); how many edge blocks
    differed from the mean by more than noise.

    Why the edges: the first block of a measured stack is often slower than the rest (Sailor's OPT-350M profile
    of A100-40GB: 20% at micro-batch 1, the other 23 blocks alike), which took such models off the shape MILP
    (8-10% from the bound after 60 s on 128-320 devices)."""
    interior, edges = _interior(p, blocks)
    by_index = {lp.index: lp for lp in p.layers}
    mine = [by_index[i] for i in interior]
    worst, means = 0.0, {}
    for name in (*_TIMES, *_BYTES):
        values = [getattr(lp, name) for lp in mine]
        if not values or any(v is None for v in values):
            continue
        worst = max(worst, _spread(values))
        means[name] = float(np.mean(values)) if name in _TIMES else int(round(np.mean(values)))
    if worst > BLOCK_NOISE or not means:
        return p, worst, 0
    apart = 0
    for e, nb in edges:
        edge = by_index[e]
        apart += any(abs(getattr(edge, name) - mean) > BLOCK_NOISE * mean for name, mean in means.items()
                     if getattr(edge, name) is not None)
        by_index[nb] = _folded(by_index[nb], edge, means)
    layers = [by_index[lp.index].model_copy(update=means) if lp.index in blocks else by_index[lp.index]
              for lp in p.layers]
    return p.model_copy(update={"layers": layers}), worst, apart


class Averaged(NamedTuple):
    cost_model: CostModel  # its profiles' blocks priced alike
    spread: float  # the largest spread among the interior blocks averaged away
    edges_apart: int  # profiles whose first or last block differed by more than noise, folded onto a neighbour


def block_averaged(cm: CostModel) -> Optional[Averaged]:
    """A cost model whose profiles price every block alike (``_averaged``); None where there is nothing to
    average (no profiles, blocks already alike) or an interior block differs by more than noise."""
    if not cm.profiles:
        return None
    blocks = sorted(li.index for li in cm.model.layers() if li.kind == "block")
    if len(blocks) < 2:
        return None
    out, worst, apart = [], 0.0, 0
    for p in cm.profiles:
        q, spread, edges = _averaged(p, blocks)
        if spread > BLOCK_NOISE:
            return None
        out.append(q)
        worst, apart = max(worst, spread), apart + (edges > 0)
    if all(q.layers == p.layers for p, q in zip(cm.profiles, out)):
        return None  # already identical
    return Averaged(replace(cm, profiles=tuple(out), notes=[]), worst, apart)
