"""``hethub plan``: plan a cluster and model, write plan.json, compare with the baselines (torch-free)."""
from __future__ import annotations

import argparse
import os
import time
from typing import Optional

from rich.console import Console

from ..partitioner.schedule_search import explain_schedules
from ..partitioner.api import BASELINES, make_baseline, make_plan, solve
from ..partitioner.costmodel import DS_CONFIG_FOR, CostModel, natural_dtype
from ..partitioner.errors import InfeasibleError, InputError
from ..partitioner.explain import explain
from ..partitioner.loaders import load_model
from ..partitioner.outputs import check_output_path, count, num, write_atomic
from ..partitioner.planner import PlannerOptions
from ..partitioner.provenance import profile_refs
from ..partitioner.records import load_cluster, load_profiles
from ..partitioner.whatif import apply_what_if
from .clock import started_s
from .show import print_plan


class _SolveStatus:
    """The planner's live status: a spinner line on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, console, every_s: float = 5.0):
        self.console, self.every_s, self.last = console, every_s, -1e9
        self.status = console.status("planning: building candidate stages ...") if console.is_terminal else None

    def __enter__(self):
        if self.status:
            self.status.__enter__()
        else:
            print("planning: building candidate stages ...", flush=True)
        return self

    def __exit__(self, *exc):
        if self.status:
            self.status.__exit__(*exc)

    def __call__(self, s: dict) -> None:
        inc, bound = s["incumbent_s"], s["bound_s"]
        gap = (inc - bound) / inc if inc < float("inf") and inc > 0 else float("nan")
        line = (f"planning: micro-batch {s['micro_batch_size']} ({s['done']}/{s['total']} sizes settled), "
                f"incumbent {num(inc)} s, bound {num(bound)} s, gap {gap:.1%}, {s['elapsed_s']:.1f} s")
        if self.status:
            self.status.update(line)
        elif s["elapsed_s"] - self.last >= self.every_s:
            self.last = s["elapsed_s"]
            print(line, flush=True)


# What a plan command does after the search, at most: write the plan, print it, and the interpreter's exit (768
# devices: 0.17 s; start-up before the search: 0.45 s)
FINISH_S = 0.2


def _time_left_s(limit_s: float) -> float:
    """What ``--time-limit`` leaves the planner: the limit is the command's, so its start-up (the interpreter,
    imports, reading the inputs, the cost model) and its finish (``FINISH_S``) come off it (768 devices: `plan
    --time-limit 10` took 10.6 s with the search given all 10). At least half of it, however long the start-up."""
    started = started_s()
    spent = 0.0 if started is None else time.perf_counter() - started + FINISH_S
    return max(limit_s - spent, limit_s / 2)


def _inputs(args: argparse.Namespace) -> tuple[CostModel, PlannerOptions, list[str]]:
    """The cost model and planner options the flags ask for, and every input file (never overwritten)."""
    cluster, model = load_cluster(args.cluster), load_model(args.model, seq_length=args.seq_length)
    profile_files = ([os.path.join(args.profiles, f) for f in os.listdir(args.profiles)]
                     if args.profiles and os.path.isdir(args.profiles) else [])
    inputs = [args.cluster, args.model, *profile_files]
    check_output_path(args.output, "--output", inputs)
    sizes = None
    if args.micro_batch_sizes:
        try:
            sizes = tuple(int(x) for x in args.micro_batch_sizes.split(","))
        except ValueError:
            raise InputError("--micro-batch-sizes", f"expected integers like 4,8,16, got {args.micro_batch_sizes!r}")
    profiles = load_profiles(args.profiles) if args.profiles else ()
    dtype, why = natural_dtype(cluster) if args.dtype == "auto" else (args.dtype, "--dtype")
    cm = CostModel(cluster, model, dtype=dtype, profiles=profiles, memory_reserve_gib=args.memory_reserve_gib,
                   zero1=args.zero1)
    cm.notes.insert(0, f"dtype {dtype} ({why}); the run trains in it: ds_config {DS_CONFIG_FOR[dtype]}")
    opts = PlannerOptions(solver=args.solver, time_limit_s=_time_left_s(args.time_limit), micro_batch_sizes=sizes,
                          max_micro_batch_size=args.max_micro_batch, allow_recompute=not args.no_recompute,
                          max_units=args.max_units, equal_widths=args.equal_widths,
                          max_tensor_parallel=args.max_tensor_parallel, mixed_types=not args.no_mixed_stages,
                          schedule=args.schedule, zero1_stages=not args.no_zero1_stages, network=args.network)
    return cm, opts, inputs


def cost_lines(plan) -> list[str]:
    """--objective cost: what each choice of device types would cost, every type included, cheapest first."""
    priced = getattr(plan.solver, "cost_subsets", None) if plan.solver else None
    if not priced:
        return []
    lines = ["cost: $ per 1M tokens by the device types rented (each set planned for throughput; * written):"]
    rows = sorted(priced, key=lambda r: (r["usd_per_million_tokens"] is None, r["usd_per_million_tokens"] or 0))
    for k, row in enumerate(rows):
        types = " + ".join(row["device_types"])
        if row["usd_per_million_tokens"] is None:
            lines.append(f"  {types}: no plan fits")
            continue
        mark = "*" if k == 0 else " "  # the cheapest is the one written
        lines.append(f"{mark} {types}: ${num(row['usd_per_million_tokens'])} at {row['samples_per_s']:,.1f} samples/s")
    return lines


def _how_planned(plan, opts: PlannerOptions, console) -> None:
    """What the plan was priced by, where that is not the default: the network model, what each set of device
    types would cost (--objective cost), blocks priced at their mean."""
    no_overlap = (plan.predicted.model_extra or {}).get("no_overlap_s") if plan.predicted else None
    if opts.network == "no-overlap" and no_overlap:
        console.print(f"network: planned without overlap (transfers on the compute's path, the whole all-reduce "
                      f"after the last backward): {plan.global_batch_size / no_overlap:,.1f} samples/s so; "
                      f"{plan.predicted.samples_per_s:,.1f} as the runtime overlaps them (the replay)", soft_wrap=True)
    for line in cost_lines(plan):
        console.print(line, soft_wrap=True)
    spread = getattr(plan.solver, "blocks_averaged_spread", None) if plan.solver else None
    folded = getattr(plan.solver, "edge_blocks_folded", 0) if plan.solver else 0
    if spread is not None:
        edges = (f"; in {folded} profile(s) the first or last block stood apart, and its difference was priced with "
                 f"the embedding or head beside it") if folded else ""
        apart = f"measured up to {spread:.1%} apart, within noise" if spread >= 5e-4 else "the others measured alike"
        console.print(f"note: the search priced every block at the blocks' mean ({apart}{edges}); the prediction "
                      f"replays them as measured", soft_wrap=True)


def cmd_plan(args: argparse.Namespace) -> int:
    cm, opts, inputs = _inputs(args)
    console = Console(width=None if Console().is_terminal else 160)
    for note in cm.notes:
        console.print(f"note: {note}")
    if "network" not in cm.cluster.model_fields_set:
        net = cm.cluster.network
        console.print(f"note: cluster {cm.cluster.name!r} has no network section: assuming {num(net.intra_gbps(''))} "
                      f"Gbit/s between devices of a node (NVLink-class; PCIe cards have far less) and "
                      f"{num(net.inter_node_gbps)} Gbit/s per node NIC; describe yours under network:")
    if args.what_if:
        return _what_if(args, cm, opts, console)
    # the homogeneous sum's single-type plans (the fastest-only baseline is one of them) and DeepSpeed's baselines:
    # made beside the search (``make_plan``)
    homogeneous: dict = {}
    baselines: dict = {}
    if args.baseline:
        plan = make_baseline(args.baseline, cm.cluster, cm.model, args.global_batch, opts=opts, cost_model=cm)
    else:
        with _SolveStatus(console) as status:
            plan = make_plan(cm.cluster, cm.model, args.global_batch, opts=opts, cost_model=cm,
                             with_homogeneous_sum=not args.no_compare, progress=status, objective=args.objective,
                             homogeneous=homogeneous, baselines=baselines)
    if args.dtype == "auto" and not args.what_if:
        used = [t for t, n in plan.devices_by_type().items() if n]
        better, _ = natural_dtype(cm.cluster, used)
        if used and better != cm.dtype:  # the dtype was set by types the plan leaves idle
            idle = sorted(set(cm.cluster.type_names) - set(used))
            console.print(f"note: the plan leaves every {', '.join(idle)} idle; the types it uses compute {better}: "
                          f"`--dtype {better}` plans in it (it may then choose other devices)")
    if args.profiles:  # recorded, so that simulate and show find them again
        plan = plan.model_copy(update={"profiles": profile_refs(args.profiles, args.output, cm.profiles)})
    print_plan(plan, console)
    _how_planned(plan, opts, console)
    tried = getattr(plan.solver, "schedules", None) if plan.solver else None
    if tried:  # --schedule auto / a chunked schedule: what each variant of the chosen groups predicted
        console.print(f"schedule: {plan.schedule}, {count(plan.num_chunks, 'chunk')} per group, of:")
        for line in explain_schedules([(t["schedule"], t["chunks"], t["iteration_s"], t["fits_memory"])
                                       for t in tried], plan):
            console.print(f"  {line}")
    split = sorted({(s.device_type, s.tensor_parallel) for s in plan.stages
                    if s.tensor_parallel > 1 and not cm.tp_measured(s.device_type, s.tensor_parallel)})
    if cm.profiles and split:  # no profile measured at that degree
        console.print("note: tensor parallel " + ", ".join(f"{t} x{k}" for t, k in split) + " priced analytically on "
                      "top of the t = 1 profiles (blocks' compute / t, plus their all-reduces on the intra-node link); "
                      "hethub profile --tensor-parallel T measures them")
    if not args.baseline and not args.no_compare:
        better = _compare(plan, cm, opts, args.global_batch, console, keep_better=args.objective == "throughput",
                          solved=homogeneous, baselines=baselines)
        if better is not plan:  # the search stopped (time limit) below a plan it computed: that one is written
            plan = better
            print_plan(plan, console)
    if args.explain:
        for line in explain(plan, cm, opts, solve):
            console.print(f"explain: {line}", soft_wrap=True)
    # written last: an interrupt or error during the comparisons or --explain leaves no plan behind
    write_atomic(args.output, plan.to_json() + "\n", "--output", inputs)
    console.print(f"wrote {args.output}")
    return 0


def _compare(plan, cm: CostModel, opts: PlannerOptions, global_batch: int, console, keep_better: bool = True,
             solved: Optional[dict] = None, baselines: Optional[dict] = None):
    """The plan's speed-up over each baseline's plan of the same cluster and model; the plan to write: the
    search's, or (``keep_better``) the best baseline's where the search ended below it (a time limit hit while
    the solver was still far from its bound): a plan is never worse than a baseline it computed."""
    best = None
    for kind in BASELINES:
        try:
            base = make_baseline(kind, cm.cluster, cm.model, global_batch, opts=opts, cost_model=cm, solved=solved,
                                 baselines=baselines)
            proven = base.solver.status in ("heuristic", "optimal") or base.solver.gap is None
            console.print(f"vs {kind}: {plan.predicted.samples_per_s / base.predicted.samples_per_s:.2f}x "
                          f"({num(base.predicted.samples_per_s)} samples/s"
                          f"{'' if proven else f'; its search: gap {base.solver.gap:.1%}'})")
        except InfeasibleError as exc:
            console.print(f"vs {kind}: baseline has no feasible plan ({exc.message})")
            continue
        if keep_better and base.predicted.samples_per_s > (best[1] if best else plan).predicted.samples_per_s:
            best = (kind, base)
    if best is None:
        return plan
    kind, base = best
    solver = plan.solver
    ended = f"{solver.status}, gap {solver.gap:.2%}" if solver and solver.gap is not None else \
        (solver.status if solver else "no solver record")
    console.print(f"note: the search ended ({ended}) below the {kind} baseline "
                  f"({base.predicted.samples_per_s / plan.predicted.samples_per_s:.2f}x its samples/s): the {kind} "
                  "plan is written instead (a longer --time-limit searches further)")
    hs = {k: getattr(plan.predicted, k) for k in ("homogeneous_sum_samples_per_s", "homogeneous_sum_bound_samples_per_s")
          if getattr(plan.predicted, k, None) is not None}
    return base.model_copy(update={
        "predicted": base.predicted.model_copy(update=hs),
        "solver": base.solver.model_copy(update={"name": f"{base.solver.name} (kept over {solver.name}: "
                                                         f"{ended})" if solver else base.solver.name})})


def _what_if(args: argparse.Namespace, cm, opts, console) -> int:
    """Plan the cluster as it is and as changed, with the same options; print both, write nothing."""
    changed = apply_what_if(cm.cluster, args.what_if)
    other = CostModel(changed, cm.model, dtype=cm.dtype,
                      profiles=[p for p in cm.profiles if p.device_type in changed.type_names],
                      memory_reserve_gib=cm.memory_reserve_gib, zero1=cm.zero1)
    results = []
    for label, model in (("now", cm), ("what-if", other)):
        try:
            plan = solve(model, args.global_batch, opts)
            results.append(plan.predicted.samples_per_s)
            console.print(f"{label}: {num(plan.predicted.samples_per_s)} samples/s on {plan.world_size} of "
                          f"{model.cluster.num_devices} devices, {count(plan.num_stages, 'stage')}")
        except InfeasibleError as exc:
            results.append(0.0)
            console.print(f"{label}: no feasible plan ({exc.message})")
    before, after = results
    change = f"{after / before - 1:+.1%}" if before > 0 else "from infeasible"
    console.print(f"what-if {args.what_if!r}: {num(before)} -> {num(after)} samples/s ({change}); no plan written")
    return 0
