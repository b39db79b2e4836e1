"""Planning entry points: ``make_plan`` (the MILP planner) and ``make_baseline``; pure, no torch."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Iterable, Optional, Sequence, Union

from .baselines import BASELINES, DEEPSPEED_METHODS, deepspeed_baseline
from .beside import Beside
from .costmodel import CostModel
from .errors import InfeasibleError, InputError
from .evaluate import REPLAY_WITHIN, choose_by_simulation
from .placement import build_plan
from .polish import polished
from .planner import PlannerOptions, search, solution_layouts, units_for
from .records import Cluster, ModelConfig, Plan, Profile, SolverInfo
from .schedule_search import AUTO, choose_schedule, search_schedule
from .schedule_kinds import BASE
from .search.noise import block_averaged



def fastest_type(cm: CostModel) -> str:
    return min(cm.cluster.type_names, key=cm.sample_s)


def _placed(cm: CostModel, global_batch: int, opts: PlannerOptions, progress) -> list[Plan]:
    """The MILP's best chain of every micro-batch size (planned for ``opts.schedule``), placed. Measured blocks
    that differ by noise only are priced alike for the search (``search.noise``); the plans are replayed with
    the times as measured."""
    averaged = block_averaged(cm)
    sol, stats = search(averaged.cost_model if averaged else cm, global_batch, opts, progress)
    noise = {"blocks_averaged_spread": averaged.spread, "edge_blocks_folded": averaged.edges_apart} if averaged else {}
    types = list(opts.device_types or cm.cluster.type_names)
    units = units_for(cm.model, opts.max_units)
    plans, unplaced = [], None
    for alt in stats["alternatives"]:
        solver = SolverInfo(name=opts.solver, status=stats["status"], gap=stats["gap"], seconds=stats["seconds"],
                            objective_s=alt.objective, candidates=stats["candidates"], units=stats["units"],
                            micro_batch_sizes=stats["micro_batch_sizes"], **noise)
        try:
            plans.append(build_plan(cm.model, cm.cluster, solution_layouts(alt, units, types), alt.b, alt.M,
                                    solver=solver, schedule=opts.schedule, dtype=cm.dtype))
        except InfeasibleError as exc:  # the MILP counts devices per type, not how nodes pack several TP groups
            unplaced = exc
    if not plans and unplaced is not None:
        raise unplaced
    return plans


def _chosen(plans: list[Plan], cm: CostModel, wanted: str, deadline: float, overlap: bool, end: float) -> Plan:
    """The best replayed of the placed plans (``overlap`` False: the best without overlap), re-cut and
    re-scheduled where ``wanted`` is chunked or auto (no variant replayed past ``end``)."""
    if overlap:  # cuts the closed form ranks better, a quarter of the time to the deadline at most
        now = time.perf_counter()
        plans = polished(plans, cm, now + POLISH_SHARE * max(deadline - now, 0.0), REPLAY_WITHIN)
    started = time.perf_counter()
    plan = choose_by_simulation(plans, cm, deadline=deadline, overlap=overlap)
    replay_s = (time.perf_counter() - started) / (plan.predicted.model_extra or {}).get("replayed", 1)
    if wanted != plan.schedule:  # chunked or auto: the MILP's groups, re-cut and re-scheduled
        chosen = {k: v for k, v in (plan.predicted.model_extra or {}).items()
                  if k in ("replayed", "ranked", "replay_apart")}  # how the groups were chosen, for --explain
        plan, tried = choose_schedule(plan, cm, wanted, overlap=overlap, deadline=end, replay_s=replay_s)
        plan = plan.model_copy(update={"predicted": plan.predicted.model_copy(update=chosen),
                                       "solver": plan.solver.model_copy(update={"schedules": [
            {"schedule": name, "chunks": v, "iteration_s": it, "fits_memory": fits} for name, v, it, fits in tried]})})
    return plan


def _rank(plan: Plan, overlap: bool) -> tuple:
    """Plans fitting memory first, then the faster: by the replay, or (``overlap`` False) without overlap."""
    extra = plan.predicted.model_extra or {}
    return (not extra.get("fits_memory", True), plan.predicted.iteration_s if overlap else extra["no_overlap_s"])


# Of the time to the replays' deadline, what moving the MILP's cuts by the closed form may take (``polish``)
POLISH_SHARE = 0.25

# ``auto`` also plans 1F1B's groups when at least this share of the time limit is left after zb-h1's (its search
# proved its plans early): on one-sample replicas queued on shared NICs, groups planned for 1F1B replayed 4% faster
# than zb-h1's under every schedule (benchmarks/results/peers.md), which the MILP's closed form cannot see.
AUTO_SECOND_SHARE = 0.5
# A schedule to choose after the MILP (auto, or a chunked one) replays each variant of the chosen groups after the
# search: the search gets this share of the time limit, so that the whole plan keeps to it (768 devices, auto:
# 11.3 s at --time-limit 10 with the search given all of it; two variant replays took 2.0 s).
RESCHEDULE_SEARCH_SHARE = 0.7


def solve(cm: CostModel, global_batch: int, opts: PlannerOptions, progress=None) -> Plan:
    """The MILP's best chains (per micro-batch size), placed; the simulator picks among the closest few."""
    started = time.perf_counter()
    wanted = opts.schedule
    milp = search_schedule(wanted)
    # (brute force: small instances, whose replays take milliseconds; it keeps the limit the user gave)
    share = RESCHEDULE_SEARCH_SHARE if wanted != milp and opts.solver != "brute-force" else 1.0
    try:
        plans = _placed(cm, global_batch, replace(opts, schedule=milp, time_limit_s=share * opts.time_limit_s),
                        progress)
    except InfeasibleError:
        if wanted != AUTO or milp == BASE:
            raise
        milp = BASE  # zb-h1's extra micro-batch on the last stage left no plan
        plans = _placed(cm, global_batch, replace(opts, schedule=milp, time_limit_s=share * opts.time_limit_s),
                        progress)
    # the placements above and the replays count against the time limit too (at least one replay is made, and a
    # tenth of the limit is theirs even when the search used it all: cheap replays of small plans must not depend
    # on how busy the machine was)
    def deadline() -> float:  # the re-scheduling's replays come after these
        end = started + opts.time_limit_s * (1 + share) / 2
        return max(end, time.perf_counter() + 0.1 * opts.time_limit_s)
    overlap = opts.network == "overlap"
    end = started + opts.time_limit_s
    chose_at = time.perf_counter()
    plan = _chosen(plans, cm, wanted, deadline(), overlap, end)
    now = time.perf_counter()
    left = opts.time_limit_s - (now - started)
    if wanted == AUTO and milp != BASE and left >= AUTO_SECOND_SHARE * opts.time_limit_s:
        # the second search gets what is left but twice what choosing among the first's plans took (their polish
        # and replays; at least half of it): given half, 1F1B's search of 64 A100 + 64 V100 ended at a 7.4% gap
        # where it proves its plan in 20 s
        second_s = max(left / 2, left - 2 * (now - chose_at))
        try:
            other = _chosen(_placed(cm, global_batch, replace(opts, schedule=BASE, time_limit_s=second_s), progress),
                            cm, wanted, deadline(), overlap, end)
        except InfeasibleError:
            other = None
        if other is not None and _rank(other, overlap) < _rank(plan, overlap):
            plan = other
    return plan.model_copy(update={"zero1": cm.zero1, "solver": plan.solver.model_copy(
        update={"seconds": time.perf_counter() - started, "network": opts.network})})


def homogeneous_plans(cm: CostModel, global_batch: int, opts: PlannerOptions) -> dict[str, Optional[Plan]]:
    """Per device type, the best plan using only that type (None where it cannot hold the model)."""
    out: dict[str, Optional[Plan]] = {}
    for t in cm.cluster.type_names:
        try:
            out[t] = solve(cm, global_batch, PlannerOptions(**{**opts.__dict__, "device_types": (t,)}))
        except InfeasibleError:
            out[t] = None
    return out


def homogeneous_sum(cm: CostModel, global_batch: int, opts: PlannerOptions) -> tuple[float, Optional[float]]:
    """Sum over device types of the best plan's samples/s using only that type (0 where it cannot hold the model):
    what HETHUB compares a heterogeneous plan with. Also the most those sub-clusters could reach by their plans'
    proven gaps (None where a plan reports none): a time-limited search may stop short on a large sub-cluster
    (the 768-device benchmark's A100-only plan: 21.66 to 22.49 samples/s from run to run), and a ratio to a
    weak sum flatters the heterogeneous plan."""
    return homogeneous_totals(homogeneous_plans(cm, global_batch, opts).values())


def homogeneous_totals(plans: Iterable[Optional[Plan]]) -> tuple[float, Optional[float]]:
    """``homogeneous_sum``'s two figures from the single-type plans (None: a type that cannot hold the model)."""
    held = [p for p in plans if p is not None]
    total = sum(p.predicted.samples_per_s for p in held)
    if any(p.solver is None or p.solver.gap is None or p.solver.gap >= 1 for p in held):
        return total, None
    return total, sum(p.predicted.samples_per_s / (1 - max(0.0, p.solver.gap)) for p in held)


OBJECTIVES = ("throughput", "cost")


def type_subsets(types: Sequence[str]) -> list[tuple[str, ...]]:
    """Which device types to rent: every non-empty subset up to 4 types; beyond, each type alone, all, and all
    but one (2^n plans would not fit a time limit)."""
    n = len(types)
    if n <= 4:
        return [tuple(t for k, t in enumerate(types) if mask >> k & 1) for mask in range(1, 2 ** n)]
    return ([(t,) for t in types] + [tuple(types)]
            + [tuple(u for u in types if u != t) for t in types])


def _cheapest(cm: CostModel, global_batch: int, opts: PlannerOptions, progress=None) -> Plan:
    """--objective cost: the plan with the fewest dollars per million tokens. Each subset of the device types
    is planned for throughput (a share of the time limit) and priced on the devices it uses; the cheapest
    wins. Within a subset the planner still uses what makes it fastest, so a cheaper plan that idles part of
    a type on purpose is not searched (README)."""
    types = list(opts.device_types or cm.cluster.type_names)
    unpriced = [t for t in types if cm.cluster.device_type(t).usd_per_hour is None]
    if unpriced:
        raise InputError("--objective", f"cost needs usd_per_hour for every device type; {unpriced[0]!r} has none "
                                        f"(set it under the cluster's device_types)")
    subsets = type_subsets(types)
    share = max(opts.time_limit_s / len(subsets), 0.5)
    best, priced = None, []
    for sub in subsets:
        try:
            plan = solve(cm, global_batch, replace(opts, device_types=sub, time_limit_s=share), progress)
        except InfeasibleError:
            priced.append({"device_types": list(sub), "usd_per_million_tokens": None, "samples_per_s": None})
            continue
        priced.append({"device_types": list(sub), "usd_per_million_tokens": plan.predicted.usd_per_million_tokens,
                       "samples_per_s": plan.predicted.samples_per_s})
        if best is None or plan.predicted.usd_per_million_tokens < best.predicted.usd_per_million_tokens:
            best = plan
    if best is None:
        return solve(cm, global_batch, opts, progress)  # raises the planner's own infeasibility line
    # what each choice of types would cost (all of them included): `plan` prints it beside the cheapest
    return best.model_copy(update={"solver": best.solver.model_copy(update={"cost_subsets": priced})})


# Each device type's own search gets a quarter of the time limit, and all of them together at most this share of
# it, so that beside the main search (``Beside``) they end with it: on 4096 devices of four types, a quarter each
# (and their replays) kept `plan --time-limit 50` waiting 96 s for them.
COMPARISONS_SHARE = 0.7


def _comparisons(cm: CostModel, global_batch: int, opts: PlannerOptions, kinds: Sequence[str]) -> dict:
    """What ``plan`` compares its plan with, as JSON (``Beside`` hands it over from its own process): each device
    type's own plan (None: that type cannot hold the model) and each DeepSpeed baseline of ``kinds`` (its plan,
    or why it has none)."""
    types = len(cm.cluster.type_names)
    limit_s = min(opts.time_limit_s / 4, COMPARISONS_SHARE * opts.time_limit_s / types)
    homog = homogeneous_plans(cm, global_batch, replace(opts, time_limit_s=limit_s))
    base: dict = {}
    for kind in kinds:
        try:
            base[kind] = {"plan": deepspeed_baseline(cm, global_batch, kind).to_json(indent=None)}
        except InfeasibleError as exc:
            base[kind] = {"infeasible": [exc.field, exc.message]}
    return {"homogeneous": {t: p.to_json(indent=None) if p is not None else None for t, p in homog.items()},
            "baselines": base}


def _decoded(found: dict) -> tuple[dict[str, Optional[Plan]], dict[str, Union[Plan, InfeasibleError]]]:
    homog = {t: Plan.from_json(text) if text is not None else None for t, text in found["homogeneous"].items()}
    base = {k: Plan.from_json(v["plan"]) if "plan" in v else InfeasibleError(*v["infeasible"])
            for k, v in found["baselines"].items()}
    return homog, base


def make_plan(cluster: Cluster, model: ModelConfig, global_batch: int, *, profiles: Sequence[Profile] = (),
              opts: PlannerOptions = PlannerOptions(), with_homogeneous_sum: bool = True,
              memory_reserve_gib: float = 2.0, zero1: bool = False, cost_model: Optional[CostModel] = None,
              progress=None, objective: str = "throughput", homogeneous: Optional[dict] = None,
              baselines: Optional[dict] = None) -> Plan:
    """The planner's best plan, with ``predicted`` and ``solver`` filled in (``progress``: see ``search``).
    ``objective``: "throughput" (samples/s) or "cost" (dollars per million tokens, ``_cheapest``). ``homogeneous``:
    a dict that receives the single-type plans behind the homogeneous sum (``make_baseline``'s ``solved``);
    ``baselines``: one that receives DeepSpeed's baselines (``make_baseline``'s ``baselines``). Those are
    searched beside the plan, in a process of their own where there is a second core (``beside``)."""
    if objective not in OBJECTIVES:
        raise InputError("--objective", f"expected one of {', '.join(OBJECTIVES)}, got {objective!r}"[:120])
    cm = cost_model or CostModel(cluster, model, profiles=profiles, memory_reserve_gib=memory_reserve_gib, zero1=zero1)
    kinds = DEEPSPEED_METHODS if baselines is not None else ()
    budget_s = opts.time_limit_s * (1 + len(cm.cluster.type_names) / 4)
    with (Beside(lambda: _comparisons(cm, global_batch, opts, kinds), budget_s) if with_homogeneous_sum
          else nullcontext()) as beside:
        plan = (_cheapest if objective == "cost" else solve)(cm, global_batch, opts, progress)
        if beside is None:
            return plan
        plans, found = _decoded(beside.result())
    if homogeneous is not None:
        homogeneous.update(plans)
    if baselines is not None:
        baselines.update(found)
    hs, bound = homogeneous_totals(plans.values())
    return plan.model_copy(update={"predicted": plan.predicted.model_copy(
        update={"homogeneous_sum_samples_per_s": hs, "homogeneous_sum_bound_samples_per_s": bound})})


def make_baseline(kind: str, cluster: Cluster, model: ModelConfig, global_batch: int, *,
                  profiles: Sequence[Profile] = (), opts: PlannerOptions = PlannerOptions(),
                  cost_model: Optional[CostModel] = None, solved: Optional[dict] = None,
                  baselines: Optional[dict] = None) -> Plan:
    """``solved``: single-type plans already searched with these options (``make_plan``'s ``homogeneous``): the
    fastest-only baseline is its type's, not a second search of the same plan (on 768 devices at ``--time-limit
    10`` that search took 7.7 s of a 28-s ``plan``). ``baselines``: DeepSpeed's, already made (``make_plan``'s
    ``baselines``: a plan, or the InfeasibleError saying why there is none)."""
    cm = cost_model or CostModel(cluster, model, profiles=profiles)
    if kind == "fastest-only":
        t = fastest_type(cm)
        plan = (solved or {}).get(t) or solve(cm, global_batch, PlannerOptions(**{**opts.__dict__,
                                                                                 "device_types": (t,)}))
    elif kind in DEEPSPEED_METHODS:
        found = (baselines or {}).get(kind)
        if isinstance(found, InfeasibleError):
            raise found
        plan = found or deepspeed_baseline(cm, global_batch, kind)
    else:
        raise InputError("--baseline", f"unknown baseline {kind!r} (one of {', '.join(BASELINES)})")
    solver = SolverInfo(name=f"baseline:{kind}", status="heuristic" if kind != "fastest-only" else
                        plan.solver.status, gap=None if kind != "fastest-only" else plan.solver.gap,
                        seconds=plan.solver.seconds if plan.solver else None)
    return plan.model_copy(update={"solver": solver})
