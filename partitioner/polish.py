"""The MILP's chains, their layer cuts moved a layer at a time while the closed form improves.

Why: the MILP prices a stage's dependency cycle as its own compute plus its boundary's latency (a candidate does
not know its neighbour), where the closed form, like the replay, counts two neighbours' compute together
(``evaluate.link_cycle_s``). Where one stage's pace bounds both, the MILP ties chains the replay tells apart:
on 32 A100 + 96 V100 (Sailor's link figures) it wrote cuts at layers 5 and 16, which replay 4.4% slower than cuts
at 6 and 17, the same stages and micro-batch. Moving a cut keeps every stage's devices, widths and sample split;
each move is checked against memory. One-chunk plans only (what the MILP writes).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from .costmodel import CostModel
from .evaluate import closed_form_s, fits_memory
from .records import Plan


def moved_cut(plan: Plan, k: int, delta: int) -> Optional[Plan]:
    """The plan with the cut between stages k and k+1 moved by ``delta`` layers (None where a stage would be left
    without a layer)."""
    first, cut = plan.stages[k].layers
    _, last = plan.stages[k + 1].layers
    if not first < cut + delta < last:
        return None
    data = plan.model_dump(exclude={"predicted"})
    data["stages"][k]["layers"] = (first, cut + delta)
    data["stages"][k + 1]["layers"] = (cut + delta, last)
    return Plan.model_validate(data)


def polish(plan: Plan, cm: CostModel, deadline: float, closed_s: Optional[float] = None) -> Plan:
    """Hill-climb ``plan``'s cuts by the closed form: the best single move of one cut by one layer that fits
    memory, while one improves it and until ``deadline`` (``time.perf_counter()``). ``closed_s``: the plan's
    closed form, where the caller has it."""
    if plan.num_chunks > 1 or plan.num_stages < 2:
        return plan
    best, best_s = plan, closed_s if closed_s is not None else closed_form_s(plan, cm)
    while time.perf_counter() < deadline:
        step = None
        for k in range(best.num_stages - 1):
            for delta in (-1, 1):
                if time.perf_counter() >= deadline:
                    break
                q = moved_cut(best, k, delta)
                if q is None:
                    continue
                q_s = closed_form_s(q, cm)
                if q_s < (step[1] if step else best_s) * (1 - 1e-9) and fits_memory(q, cm):
                    step = (q, q_s)
        if step is None:
            break
        best, best_s = step
    return best


def polished(plans: Sequence[Plan], cm: CostModel, deadline: float, within: float) -> list[Plan]:
    """``plans``, best closed form first, those within ``within`` x the best polished (``polish``) until
    ``deadline``, each followed by its MILP cuts where polishing moved them (the replay decides between the
    two: on 80 A100 + 240 V100, 1F1B, the closed form moved a cut by one layer for 0.1% and the plan replayed
    1.5% slower); the rest as they were."""
    scored = sorted(((closed_form_s(p, cm), k, p) for k, p in enumerate(plans)), key=lambda x: x[:2])
    out = []
    for s, _, p in scored:
        q = polish(p, cm, deadline, s) if s <= within * scored[0][0] else p
        out += [q] if q is p else [q, p]
    return out
