"""Planning entry points: ``make_plan`` (the MILP planner) and ``make_baseline``; pure, no torch."""
from __future__ import annotations

import time
from typing import Optional, Sequence

from .baselines import deepspeed_baseline
from .costmodel import CostModel
from .errors import InfeasibleError, InputError
from .evaluate import choose_by_simulation
from .placement import build_plan
from .planner import PlannerOptions, search, solution_layouts, units_for
from .records import Cluster, ModelConfig, Plan, Profile, SolverInfo

BASELINES = ("uniform", "parameters", "fastest-only")


def fastest_type(cm: CostModel) -> str:
    return min(cm.cluster.type_names, key=cm.sample_s)


def _solve(cm: CostModel, global_batch: int, opts: PlannerOptions, progress=None) -> Plan:
    """The MILP's best chains (per micro-batch size), placed; the simulator picks among the closest few."""
    sol, stats = search(cm, global_batch, opts, progress)
    types = list(opts.device_types or cm.cluster.type_names)
    units = units_for(cm.model, opts.max_units)
    plans = []
    for alt in stats["alternatives"]:
        solver = SolverInfo(name=opts.solver, status=stats["status"], gap=stats["gap"], seconds=stats["seconds"],
                            objective_s=alt.objective, candidates=stats["candidates"], units=stats["units"],
                            micro_batch_sizes=stats["micro_batch_sizes"])
        plans.append(build_plan(cm.model, cm.cluster, solution_layouts(alt, units, types), alt.b, alt.M,
                                solver=solver))
    t0 = time.perf_counter()
    plan = choose_by_simulation(plans, cm)
    return plan.model_copy(update={"zero1": cm.zero1, "solver": plan.solver.model_copy(
        update={"seconds": stats["seconds"] + time.perf_counter() - t0})})


def homogeneous_sum(cm: CostModel, global_batch: int, opts: PlannerOptions) -> float:
    """Sum over device types of the best plan's samples/s using only that type (0 where it cannot hold the model)."""
    total = 0.0
    for t in cm.cluster.type_names:
        sub = PlannerOptions(**{**opts.__dict__, "device_types": (t,)})
        try:
            total += _solve(cm, global_batch, sub).predicted.samples_per_s
        except InfeasibleError:
            pass
    return total


def make_plan(cluster: Cluster, model: ModelConfig, global_batch: int, *, profiles: Sequence[Profile] = (),
              opts: PlannerOptions = PlannerOptions(), with_homogeneous_sum: bool = True,
              memory_reserve_gib: float = 2.0, zero1: bool = False, cost_model: Optional[CostModel] = None,
              progress=None) -> Plan:
    """The planner's best plan, with ``predicted`` and ``solver`` filled in (``progress``: see ``search``)."""
    cm = cost_model or CostModel(cluster, model, profiles=profiles, memory_reserve_gib=memory_reserve_gib, zero1=zero1)
    plan = _solve(cm, global_batch, opts, progress)
    if with_homogeneous_sum:
        hs = homogeneous_sum(cm, global_batch, PlannerOptions(**{**opts.__dict__,
                                                                "time_limit_s": opts.time_limit_s / 4}))
        plan = plan.model_copy(update={"predicted": plan.predicted.model_copy(
            update={"homogeneous_sum_samples_per_s": hs})})
    return plan


def make_baseline(kind: str, cluster: Cluster, model: ModelConfig, global_batch: int, *,
                  profiles: Sequence[Profile] = (), opts: PlannerOptions = PlannerOptions(),
                  cost_model: Optional[CostModel] = None) -> Plan:
    cm = cost_model or CostModel(cluster, model, profiles=profiles)
    if kind == "fastest-only":
        t = fastest_type(cm)
        plan = _solve(cm, global_batch, PlannerOptions(**{**opts.__dict__, "device_types": (t,)}))
    elif kind in ("uniform", "parameters"):
        plan = deepspeed_baseline(cm, global_batch, kind)
    else:
        raise InputError("--baseline", f"unknown baseline {kind!r} (one of {', '.join(BASELINES)})")
    solver = SolverInfo(name=f"baseline:{kind}", status="heuristic" if kind != "fastest-only" else
                        plan.solver.status, gap=None if kind != "fastest-only" else plan.solver.gap,
                        seconds=plan.solver.seconds if plan.solver else None)
    return plan.model_copy(update={"solver": solver})
