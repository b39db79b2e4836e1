"""The schedule and chunk count a plan runs (``hethub plan --schedule``): the MILP plans one chunk per group; this
step re-cuts the chosen groups into chunks and keeps the fastest schedule that fits memory.

Why after the MILP and not inside it: a chunked schedule keeps the MILP's groups (devices, widths, sample splits,
tensor parallel, ZeRO-1), which are what balance the pipeline; it changes the fill, the boundary traffic and the
activations in flight, which the replay prices exactly and the MILP's linear cost cannot (the fill depends on the
order of the passes). Each variant keeps every group's layer count, cut into chunks and then balanced by time
(``chunked.balanced_sizes``), so a group's chunks take the work the MILP gave it.
"""
from __future__ import annotations

import time
from typing import Optional

from .chunked import rechunk
from .costmodel import CostModel
from .errors import InputError
from .evaluate import chunk_time_s, fits_memory, predict, replay_fits, with_pass_times
from .records import SCHEDULES, Plan
from .simulator import OutOfTime

from .options import AUTO
from .outputs import num
from .schedule_kinds import AUTO_MILP, kind as schedule_kind
MAX_CHUNKS_SEARCHED = 4  # v of interleaved-1f1b tried: 2..4 (the fill shrinks ~v-fold for v x the traffic)


def variants(plan: Plan, cm: CostModel, schedule: str) -> list[Plan]:
    """The plan under ``schedule`` (``auto``: under every schedule, but only one-chunk ones for a one-stage plan),
    chunked where the schedule is, v from 2 to MAX_CHUNKS_SEARCHED for interleaved-1f1b (no group cut into more
    chunks than it has layers)."""
    names = list(SCHEDULES) if schedule == AUTO else [schedule]
    if schedule == AUTO and plan.num_stages == 1:  # no pipeline: chunks of one group only add transfers to itself
        names = [n for n in names if not schedule_kind(n).chunked]
    chunk_s = chunk_time_s(plan, cm)
    out = []
    for name in names:
        if not schedule_kind(name).chunked:
            out.append(plan.model_copy(update={"schedule": name, "predicted": None}))
            continue
        fixed = schedule_kind(name).fixed_chunks
        counts = [fixed] if fixed else range(2, MAX_CHUNKS_SEARCHED + 1)
        for v in counts:
            if any(st.layer_count() < v for st in plan.stages):  # a group cannot hold more chunks than layers
                continue
            out.append(with_pass_times(rechunk(plan, name, v, chunk_s), cm))
    return out


def choose_schedule(plan: Plan, cm: CostModel, schedule: str, replay_all: bool = False, overlap: bool = True,
                    deadline: Optional[float] = None, replay_s: float = 0.0
                    ) -> tuple[Plan, list[tuple[str, int, Optional[float], bool]]]:
    """The fastest variant (``variants``) that fits memory, with its prediction, and what each variant predicted:
    (schedule, chunks per group, iteration seconds, fits memory). None fits: the fastest, marked as not fitting,
    as ``hethub plan`` reports an over-memory plan. ``auto`` leaves out chunked variants too long to replay
    (``evaluate.replay_fits``): their prediction would be the closed form, which only ranks chunked plans.

    Where some variant fits, the ones that do not are not replayed (iteration None): none of them can be chosen,
    and on the 768-device benchmark their replays were 19 of the 21 s ``auto`` took after the MILP's 10.
    ``replay_all`` replays them too (the schedule benchmark lists what each would take). ``overlap`` False
    (``--network no-overlap``): the variant fastest without overlap is kept (an interleaved one replayed fastest
    but moved more boundary traffic: 21% slower so on 128 devices).

    The variant ``plan`` already is keeps its prediction (a replay: on 768 devices in 49 stages, 3.2 s). Past
    ``deadline`` (``time.perf_counter()``; judged by the longest replay yet, at first ``replay_s``, how long the
    plan's own replay took) the other variants are not replayed
    (iteration None, fitting memory): `plan --time-limit` keeps to its limit rather than to every variant."""
    kept = []
    for q in variants(plan, cm, schedule):
        if schedule == AUTO and schedule_kind(q.schedule).chunked and not replay_fits(q):
            continue
        kept.append((q, fits_memory(q, cm)))
    some_fit = any(fits for _, fits in kept)
    homog = plan.predicted.homogeneous_sum_samples_per_s if plan.predicted else None
    tried: list[tuple[Plan, Optional[float], bool]] = []
    took_s = replay_s
    mine = (plan.schedule, plan.num_chunks) if plan.predicted is not None else None  # the variant already replayed
    own = any((q.schedule, q.num_chunks) == mine and (fits or not some_fit or replay_all) for q, fits in kept)
    for q, fits in kept:
        if some_fit and not fits and not replay_all:
            tried.append((q, None, fits))
            continue
        later = own or any(t[1] is not None for t in tried)  # (some variant has its replay: a deadline holds)
        if (q.schedule, q.num_chunks) == mine:
            pred = plan.predicted  # the same plan, already replayed
        elif deadline is not None and later and time.perf_counter() + 1.25 * took_s >= deadline:
            tried.append((q, None, fits))  # out of time
            continue
        else:
            started = time.perf_counter()
            try:
                pred = predict(q, cm, homog, deadline=deadline if later else None)
            except OutOfTime:  # ran past the deadline after all: dropped, as if never started
                tried.append((q, None, fits))
                continue
            took_s = max(took_s, time.perf_counter() - started)
        tried.append((q.model_copy(update={"predicted": pred}), pred.iteration_s, fits))
    replayed = [t for t in tried if t[1] is not None]  # (a variant not replayed is never chosen)
    fitting = [t for t in replayed if t[2]] or replayed
    # without overlap, variants the model prices alike (1F1B and zb-h1 charge the same path) go by their replay
    best = min(fitting, key=lambda t: t[1] if overlap else (t[0].predicted.model_extra["no_overlap_s"], t[1]))[0]
    return best, [(q.schedule, q.num_chunks, it, fits) for q, it, fits in tried]


def search_schedule(opts_schedule: str) -> str:
    """The schedule the MILP plans with: its own for one-chunk schedules; zb-h1 for ``auto``; else 1F1B (whose
    groups are re-cut). Why zb-h1 for auto: it was the fastest variant on every benchmark plan, and groups
    planned for it fit 1F1B too (it holds one micro-batch more on the last stage, and what a weight pass waits
    with), which ``auto`` replays beside it; planned for 1F1B, the 768-device plan ran zb-h1 1% slower than
    planned for zb-h1. Where zb-h1's memory leaves no plan, ``api.solve`` plans for 1F1B."""
    if opts_schedule not in SCHEDULES and opts_schedule != AUTO:
        raise InputError("PlannerOptions.schedule", f"expected one of {', '.join([*SCHEDULES, AUTO])}, got {opts_schedule!r}"[:160])
    if opts_schedule == AUTO:
        return AUTO_MILP
    return schedule_kind(opts_schedule).milp


def explain_schedules(tried: list[tuple[str, int, Optional[float], bool]], chosen: Plan) -> list[str]:
    """One line per variant tried: its predicted iteration against the chosen one's (variants not replayed, as
    they do not fit memory, last)."""
    base: Optional[float] = chosen.predicted.iteration_s if chosen.predicted else None
    lines = []
    for name, v, it, fits in sorted(tried, key=lambda t: (t[2] is None, t[2] or 0.0)):
        mark = "*" if (name, v) == (chosen.schedule, chosen.num_chunks) else " "
        if it is None:
            lines.append(f"{mark} {name:<17} v={v}  " + ("does not fit memory (not replayed)" if not fits else
                                                         "not replayed (the time limit was spent)"))
            continue
        rel = f" ({it / base:.3f}x)" if base else ""
        lines.append(f"{mark} {name:<17} v={v}  {num(it * 1e3):>9} ms/iteration{rel}"
                     + ("" if fits else "  (does not fit memory)"))
    return lines
