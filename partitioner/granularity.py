"""What whole layers cost a plan: the pace its device groups would keep if a cut could fall inside a layer.

The planner cuts the pipeline between layers (the embedding, each transformer block, the head). When one block
is a large share of a group's work, no cut balances the groups: on 8 A100 + 8 V100 (gpt-1.3b) moving one block
from the V100 group to the A100 group takes 11 ms from one and adds 3.7 ms to the other, and the best cut leaves
the busiest group at 86.7 ms per micro-batch where a balance would be 85.2. This module prices that loss, so
``hethub plan --explain`` can say how much of a plan's distance from its bound is layer granularity, which no
schedule or solver setting recovers.

The same groups (devices, widths, sample splits, tensor parallel, recompute) keep their order; each layer's time
on a group is taken as spread evenly over the layer, so a group may end part-way through one. That is a bound
for planning units finer than a block on these groups (attention and MLP apart, say), not for a different set
of groups: it says what the granularity costs this plan.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .costmodel import CostModel
from .evaluate import chunk_time_s
from .outputs import num
from .records import Plan
from .schedule_kinds import kind as schedule_kind

BISECTIONS = 60


def fractional_pace_s(prefix_s: np.ndarray) -> float:
    """The least work of the busiest group over every cut of the layers into one contiguous range per group, in
    pipeline order, cuts allowed inside a layer. ``prefix_s[g][l]``: group g's seconds for layers [0, l)
    (non-decreasing), linear within a layer. Bisection on the bound: the groups in turn each take as much as
    fits, which covers every layer exactly when any cut within the bound does."""
    groups, n = prefix_s.shape[0], prefix_s.shape[1] - 1
    edges = np.arange(n + 1, dtype=float)

    def covers(bound: float) -> bool:
        x = 0.0
        for g in range(groups):
            p = prefix_s[g]
            target = float(np.interp(x, edges, p)) + bound
            x = float(n) if target >= p[-1] else float(np.interp(target, p, edges))
        return x >= n

    lo, hi = 0.0, float(prefix_s[:, -1].max())  # one group taking every layer, the others none
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if covers(mid) else (mid, hi)
    return hi


def group_prefix_s(plan: Plan, cm: CostModel) -> np.ndarray:
    """Per group of a one-chunk plan, its forward + backward seconds of layers [0, l) per micro-batch, l = 0..L
    (``CostModel.prefix`` per sample plus ``prefix_fixed`` per call, as the planner prices a range), on its
    slowest replica: for a group of two types, the larger of the two types' prefixes at each l (exact for one
    type; a mixed group's shares are split by speed, so its types' prefixes nearly agree)."""
    out = []
    for st in plan.stages:
        rc = st.recompute
        shares = [cm.prefix(t, rc, tp) * n + cm.prefix_fixed(t, rc, tp)
                  for t, n, tp in {(st.type_of(r), r.samples, st.degree_of(r)) for r in st.replicas}]
        out.append(np.max(shares, axis=0))
    return np.array(out)


def granularity(plan: Plan, cm: CostModel) -> Optional[tuple[float, float, float]]:
    """(the busiest group's seconds per micro-batch as planned, the same groups' busiest with cuts anywhere, the
    plan's predicted iteration seconds at that pace), or None for a one-stage plan (no cut to move), a chunked
    plan (its groups hold several ranges, which the same sweep does not cover) or one without a prediction. The
    iteration estimate takes the busiest group as pacing all M micro-batches, as it does in the closed form."""
    if plan.num_stages == 1 or schedule_kind(plan.schedule).chunked or plan.predicted is None:
        return None
    chunk_s = chunk_time_s(plan, cm)
    planned = max(chunk_s(g, *st.layers) for g, st in enumerate(plan.stages))
    fractional = min(planned, fractional_pace_s(group_prefix_s(plan, cm)))
    return planned, fractional, plan.predicted.iteration_s - plan.num_micro_batches * (planned - fractional)


def granularity_line(plan: Plan, cm: CostModel) -> Optional[str]:
    """``--explain``'s sentence on what whole layers cost this plan (None where ``granularity`` is)."""
    got = granularity(plan, cm)
    if got is None:
        return None
    planned, fractional, iteration_s = got
    gain = plan.predicted.iteration_s / iteration_s - 1
    return (f"layers: the busiest group computes {num(planned * 1e3)} ms per micro-batch; cut anywhere, inside a "
            f"layer too, these groups would balance at {num(fractional * 1e3)} ms, about {gain:.1%} more samples/s. "
            f"Plans cut between layers, so that is what their granularity costs this plan")
