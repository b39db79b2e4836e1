"""``hethub simulate``: replay one iteration of a plan event by event, against its prediction (torch-free)."""
from __future__ import annotations

import argparse

from ..partitioner.costmodel import cost_model_for
from ..partitioner.errors import InputError
from ..partitioner.evaluate import (closed_form_s, replay_fits, replay_iteration_s, replay_limit_message,
                                     replay_micro_batches, with_micro_batches)
from ..partitioner.outputs import check_output_path, count, num
from ..partitioner.provenance import recorded_profiles, unrecorded
from ..partitioner.records import load_plan, load_profiles
from ..partitioner.schedule import build_schedule, format_schedule, read_schedule_file
from ..partitioner.simulator import require_matplotlib, simulate, write_png, write_trace

TIMELINE_BUDGET = 1_000  # (rank, micro-batch) pairs drawn in a PNG or Chrome trace


BUSY_LISTED = 8  # a stage wider than this prints its replicas' busy range, not each


def _busy(stage, busy: dict[int, float]) -> str:
    """Each replica's share of the iteration spent computing; a wide stage's as min/median/max."""
    if stage.width <= BUSY_LISTED:
        return ", ".join(f"r{r.rank} {busy[r.rank]:.0%}" for r in stage.replicas)
    shares = sorted(busy[r.rank] for r in stage.replicas)
    return (f"{stage.width} replicas, min {shares[0]:.0%}, median {shares[len(shares) // 2]:.0%}, "
            f"max {shares[-1]:.0%}")


def _profiles(plan, args: argparse.Namespace) -> list:
    """--profiles DIR, else the profiles the plan records (where their bytes still match); says which."""
    if args.profiles:
        profiles = load_profiles(args.profiles)  # first: a missing folder is one line, not a traceback
        for note in unrecorded(plan, args.profiles):
            print(f"note: {note}")
        return profiles
    if not plan.profiles:
        return []
    found, missing = recorded_profiles(plan, args.plan)
    if missing:
        for note in missing:
            print(f"note: {note}")
        print("note: simulating with the analytic cost model, which the plan's prediction did not use; "
              "--profiles DIR names the profiles")
        return []
    print(f"profiles: {len(found)} the plan records (bytes unchanged)")
    return found


def cmd_simulate(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    inputs = (args.plan, args.schedule)
    for path, flag in ((args.trace, "--trace"), (args.png, "--png")):
        if path:
            check_output_path(path, flag, inputs)
    if args.png:
        require_matplotlib()  # before the replay, not after it
    cm = cost_model_for(plan, _profiles(plan, args))
    if not args.schedule and not replay_fits(plan):
        raise InputError("plan", f"{replay_limit_message(plan)}; the closed form predicts "
                                 f"{closed_form_s(plan, cm) * 1e3:.3f} ms")
    m = plan.num_micro_batches if args.schedule else replay_micro_batches(plan)
    shown = plan if m == plan.num_micro_batches else with_micro_batches(plan, m)
    sched = read_schedule_file(args.schedule) if args.schedule else build_schedule(shown)
    if args.print_schedule:
        for r in sorted(sched):
            print(f"{r}: {format_schedule(sched[r])}")
    res = simulate(shown, cm, sched if args.schedule else None)
    it = res.iteration_s if shown is plan else replay_iteration_s(plan, cm, t1=res.iteration_s)
    if shown is not plan:
        print(f"note: {plan.num_micro_batches} micro-batches on {plan.world_size} ranks: replayed {m} and "
              f"{max(plan.num_stages + 1, m // 2)}, extrapolated linearly; busy and timeline show {m}")
    pred = (f"predicted {plan.predicted.iteration_s * 1e3:.3f} ms, {plan.predicted.iteration_s / it - 1:+.1%}"
            if plan.predicted is not None else "the plan holds no prediction")
    print(f"schedule: {args.schedule if args.schedule else plan.schedule}")
    print(f"iteration {it * 1e3:.3f} ms, {num(plan.global_batch_size / it)} samples/s, "
          f"bubble {res.bubble_fraction:.1%} ({pred}; closed form {closed_form_s(plan, cm) * 1e3:.3f} ms)")
    for st in plan.stages:
        print(f"stage {st.index} ({st.device_type}): busy {_busy(st, res.busy)}")
    if (args.trace or args.png) and shown.world_size * shown.num_micro_batches > TIMELINE_BUDGET and not args.schedule:
        m_t = max(2 * plan.num_stages + 2, TIMELINE_BUDGET // plan.world_size)
        shown = with_micro_batches(plan, min(m_t, plan.num_micro_batches))
        res = simulate(shown, cm)
        print(f"note: the timeline shows the first {shown.num_micro_batches} of {plan.num_micro_batches} micro-batches")
    if args.trace:
        write_trace(res, shown, args.trace, inputs)
        print(f"wrote {args.trace}")
    if args.png:
        partial = (f" (timeline: the first {shown.num_micro_batches} of {plan.num_micro_batches} micro-batches)"
                   if shown.num_micro_batches != plan.num_micro_batches else "")
        title = (f"{plan.model.name}: {count(plan.num_stages, 'stage')}, {count(plan.world_size, 'rank')}, predicted "
                 f"{it * 1e3:.1f} ms/iteration (simulated){partial}")
        write_png(res, shown, args.png, title=title, inputs=inputs)
        print(f"wrote {args.png}")
    return 0
