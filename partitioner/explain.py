"""``hethub plan --explain``: for each device type the plan leaves (partly) idle, which constraint keeps
those devices out, and what would bring them in.

The reasons are checked in order, each against the cost model the planner used:

- memory: not even one block (split over the type's largest tensor-parallel group) with its weights,
  gradients, optimizer state and one sample's activations fits a device of the type;
- batch: every replica needs at least one sample of a micro-batch, so a stage has at most
  micro-batch-size replicas; the type's stages are already that wide;
- divisibility: the leftover is smaller than the tensor-parallel group the type's stages use, or than a
  node's free slots can pack;
- bound: none of those; the solver found no faster plan that uses them (a stage of them would add more
  bubble than compute, or the pipeline's balance leaves no layers to give them), within its proven gap.

What would bring them in is answered by planning again at 2, 4 and 8 times the global batch (more samples per
micro-batch allow wider stages, and more micro-batches shrink the bubble a deeper pipeline adds).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .evaluate import REPLAY_WITHIN, no_overlap_s
from .costmodel import CostModel
from .errors import InfeasibleError
from .granularity import granularity_line
from .planner import PlannerOptions, tensor_parallel_degrees
from .records import Plan


def idle_reason(plan: Plan, cm: CostModel, t: str, idle: int) -> str:
    """Which constraint keeps ``idle`` devices of type ``t`` out of ``plan`` (one phrase, numbers included)."""
    degrees = tensor_parallel_degrees(cm, t, 8)
    tp = max(degrees)
    n = cm.model.num_planner_layers
    block = n // 2
    need = (float(cm.state_bytes_of(cm.range_params(block, block + 1, tp), 1))
            + float(cm.act_bytes(tp)[block]) + float(cm.layers.act_bytes_recompute[block]))
    limit = cm.memory_limit_bytes(t)
    if need > limit:
        return (f"memory: one block split {tp} ways needs {need / 2**30:.1f} GiB per device (state and one "
                f"sample's activations), a {t} holds {limit / 2**30:.1f} GiB after the reserve")
    stages = [st for st in plan.stages if t in st.types]
    b = plan.micro_batch_size
    if stages and all(st.width >= b for st in stages):
        return (f"batch: a replica needs at least one of the micro-batch's {b} samples, and every {t} stage "
                f"already has {b} replicas")
    used_tp = min((st.tensor_parallel for st in stages), default=1)
    if stages and idle < used_tp:
        return (f"divisibility: {idle} left over, fewer than the tensor-parallel group of {used_tp} its stages "
                f"use")
    gap = plan.solver.gap if plan.solver is not None and plan.solver.gap is not None else None
    return ("bound: no faster plan uses them (a stage of them would add more pipeline bubble or transfer than "
            "compute)" + (f"; proven within {gap:.1%} of the best" if gap is not None else ""))


def explain(plan: Plan, cm: CostModel, opts: PlannerOptions, solve) -> list[str]:
    """One line per device type: used/total, and for idle ones the reason and a what-if that brings them in;
    then what cutting only between layers costs the plan (``granularity``).
    ``solve(cm, global_batch, opts)`` is the planner (passed in: this module does not import the API)."""
    used = plan.devices_by_type()
    lines = []
    plans: dict[int, Optional[Plan]] = {}  # global batch -> its plan (None: infeasible), shared by every idle type
    for t, total in cm.cluster.count_by_type().items():
        u = used.get(t, 0)
        if u >= total:
            lines.append(f"{t}: all {total} used")
            continue
        line = f"{t}: {u} of {total} used; {total - u} idle — {idle_reason(plan, cm, t, total - u)}"
        hint = _bring_in(plan, cm, opts, solve, t, u, plans)
        lines.append(line + (f"; {hint}" if hint else ""))
    layers = granularity_line(plan, cm)
    return lines + ([layers] if layers else []) + _replay_lines(plan, cm)


def _replay_lines(plan: Plan, cm: CostModel) -> list[str]:
    """How the written plan was chosen: the closed form ranked, the replay decided (``choose_by_simulation``)."""
    p = plan.predicted
    extra = (p.model_extra or {}) if p is not None else {}
    if p is None or extra.get("closed_form_s") is None:
        return []
    line = (f"closed form {extra['closed_form_s'] * 1e3:.1f} ms vs replay {p.iteration_s * 1e3:.1f} ms "
            f"({extra['closed_form_s'] / p.iteration_s - 1:+.1%})")
    line += (f"; without overlap (transfers on the compute's path, the whole all-reduce after the last backward, "
             f"as Sailor's simulator prices them) {plan.global_batch_size / no_overlap_s(plan, cm):,.1f} samples/s, "
             f"{p.samples_per_s:,.1f} with it")
    if extra.get("replayed"):
        apart = (f", their closed forms at most {extra['replay_apart']:.1%} from their replays"
                 if extra.get("replay_apart") is not None else "")
        line = (f"replayed {extra['replayed']} of the {extra['ranked']} best plans the MILP ranked (by the closed "
                f"form, within {REPLAY_WITHIN:g}x of its best{apart}); the written one's " + line)
    return [line]


def _bring_in(plan: Plan, cm: CostModel, opts: PlannerOptions, solve, t: str, used: int,
              plans: dict[int, Optional[Plan]]) -> str:
    """A what-if that uses more devices of ``t``: the global batch doubled, up to 8x (compared per sample).
    ``plans`` holds the what-ifs solved so far (another idle type asks for the same batches)."""
    G = plan.global_batch_size
    quick = replace(opts, time_limit_s=max(opts.time_limit_s / 4, 1.0))
    for factor in (2, 4, 8):
        if factor * G not in plans:
            try:
                plans[factor * G] = solve(cm, factor * G, quick)
            except InfeasibleError:
                plans[factor * G] = None
        bigger = plans[factor * G]
        if bigger is None:
            continue
        more = bigger.devices_by_type().get(t, 0)
        if more > used:
            gain = bigger.predicted.samples_per_s / plan.predicted.samples_per_s - 1
            return f"global batch {factor * G} would use {more} of them: {gain:+.1%} samples/s"
    return f"up to global batch {8 * G} no plan uses more of them"
