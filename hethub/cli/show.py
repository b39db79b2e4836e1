"""Human summary of a plan (``hethub show``): a rich table, one row per stage."""
from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from ..events import plan_files
from ..partitioner.errors import InputError
from ..partitioner.outputs import count, num
from ..partitioner.provenance import as_notes
from ..partitioner.records import Plan, load_plan


def _hosts(stage) -> str:
    by_host: dict[str, list[int]] = {}
    for r in stage.replicas:
        by_host.setdefault(r.host, []).extend(stage.slots_of(r))
    return " ".join(f"{h}:{','.join(map(str, s))}" for h, s in by_host.items())


def _ranks(stage) -> str:
    """Replicas' ranks; a tensor-parallel group in brackets: [2,3] [4,5]."""
    if stage.tensor_parallel == 1:
        return ",".join(str(r.rank) for r in stage.replicas)
    return " ".join("[" + ",".join(map(str, stage.ranks_of(r))) + "]" for r in stage.replicas)


def _degrees(stage) -> str:
    """The stage's tensor-parallel degree; per replica where they differ (1+1+4)."""
    return str(stage.tensor_parallel) if stage.uniform_tp else "+".join(map(str, stage.degrees))


def plan_table(plan: Plan) -> Table:
    pred = plan.predicted
    t = Table(title=f"{plan.model.name} on {plan.cluster.name}: {count(plan.num_stages, 'stage')}, "
                    f"{count(plan.world_size, 'rank')}")
    chunked = plan.num_chunks > 1  # a group's chunks, pipeline order within it
    for col in ("group" if chunked else "stage", "chunks" if chunked else "layers", "device", "width", "tp",
                "samples/replica", "ranks", "hosts:slots", "recompute", "zero1"):
        t.add_column(col)
    if pred and pred.stage_s:
        t.add_column("stage ms", justify="right")
        t.caption = ("stage ms: one micro-batch's forward, backward and boundary transfers on the stage's slowest "
                     "replica, not the iteration's pace (plan --explain breaks that down)")
    # small models (a measured CNN) in MiB: 0.00 GiB would hide what they hold
    mib = bool(pred and pred.memory_gib) and max(pred.memory_gib) < 0.1
    if pred and pred.memory_gib:
        t.add_column("memory MiB" if mib else "memory GiB", justify="right")
    for st in plan.stages:
        row = [str(st.index), " ".join(f"[{a}, {b})" for a, b in st.chunk_ranges),
               "+".join(st.types), str(st.width), _degrees(st), "+".join(str(r.samples) for r in st.replicas),
               _ranks(st), _hosts(st), "yes" if st.recompute else "no", "yes" if plan.shards_optimizer(st) else "no"]
        if pred and pred.stage_s:
            row.append(f"{pred.stage_s[st.index] * 1e3:.2f}" if st.index < len(pred.stage_s) else "")
        if pred and pred.memory_gib:
            gib = pred.memory_gib[st.index] if st.index < len(pred.memory_gib) else None
            row.append("" if gib is None else f"{gib * 1024:.2f}" if mib else f"{gib:.2f}")
        t.add_row(*row)
    return t


def print_plan(plan: Plan, console: Console | None = None) -> None:
    # Not a terminal (CI logs, pipes): rich would wrap at 80 columns and cut the table's cells.
    console = console or Console(width=None if Console().is_terminal else 160)
    console.print(plan_table(plan))
    console.print(f"global batch {plan.global_batch_size} = micro-batch {plan.micro_batch_size} "
                  f"x {plan.num_micro_batches} micro-batches, schedule {plan.schedule}"
                  + (f", dtype {plan.dtype}" if plan.dtype else ""))
    p = plan.predicted
    if p:
        line = f"predicted: {num(p.iteration_s * 1e3)} ms/iteration (simulated), {num(p.samples_per_s)} samples/s"
        if p.upper_bound_samples_per_s:
            line += f", upper bound {num(p.upper_bound_samples_per_s)} samples/s"
        if p.efficiency is not None:
            line += f", efficiency {p.efficiency:.1%}"
        if p.homogeneous_sum_samples_per_s:
            line += f", {p.samples_per_s / p.homogeneous_sum_samples_per_s:.1%} of the homogeneous sub-clusters' sum"
            bound = p.homogeneous_sum_bound_samples_per_s
            if bound and bound > p.homogeneous_sum_samples_per_s * (1 + 1e-6):  # a sub-cluster plan is unproven
                line += f" (at least {p.samples_per_s / bound:.1%} of what they could reach, by their proven gaps)"
        if p.usd_per_million_tokens is not None:
            line += f", ${num(p.usd_per_million_tokens)} per 1M tokens"
        console.print(line)
    console.print("priced with: " + (f"profiles {as_notes(plan.profiles)}" if plan.profiles
                                     else "the analytic cost model"), soft_wrap=True)
    used, total = plan.devices_by_type(), plan.cluster.count_by_type()
    console.print("devices used: " + ", ".join(f"{t} {used.get(t, 0)}/{n}" for t, n in total.items()))
    if plan.solver:
        s = plan.solver
        console.print(f"solver: {s.name}, {s.status}"
                      + (f", gap {s.gap:.2%}" if s.gap is not None else "")
                      + (f", {s.seconds:.2f} s" if s.seconds is not None else "")
                      + (", planned without overlap (--network no-overlap)"
                         if getattr(s, "network", None) == "no-overlap" else ""))
    for line in bridge_lines(plan):
        console.print(line)
    idle = plan.idle_devices()
    if idle:
        console.print(f"idle devices ({len(idle)}): "
                      + ", ".join(f"{h}:{k} ({t})" for h, k, t in idle[:12]) + (" ..." if len(idle) > 12 else ""))


def bridge_lines(plan: Plan) -> list[str]:
    """Each boundary between vendors (NVIDIA -> AMD): its traffic goes device -> host -> device over the host
    bridge (gloo, ``transport: host``), slower than either vendor's own links, so a reader should see where."""
    vendor = lambda t: plan.cluster.device_type(t).vendor  # noqa: E731
    out = []
    for k in range(len(plan.pipeline) - 1):
        here, there = plan.stages[plan.pipeline[k].group], plan.stages[plan.pipeline[k + 1].group]
        a, b = {vendor(t) for t in here.types}, {vendor(t) for t in there.types}
        if a != b or len(a) > 1:
            bd = plan.boundary(k)
            wire = f", cast to {bd.dtype} on the wire" if bd is not None and bd.dtype else ""
            out.append(f"host bridge after chunk {k} (group {here.index} {'+'.join(sorted(a))} -> group "
                       f"{there.index} {'+'.join(sorted(b))}): device -> host -> device over gloo{wire}")
    return out


def cmd_show(args: argparse.Namespace) -> int:
    if os.path.isdir(os.path.join(args.plan, "plans")):  # an elastic run's checkpoint directory
        print_run(args.plan)
    else:
        print_plan(load_plan(args.plan))
    return 0


def run_plans(checkpoint_dir: str) -> list[tuple[int, Plan]]:
    """(step it took over at, plan) of every plan an elastic run ran under (``DIR/plans/step-<k>.json``), by step."""
    if not os.path.isdir(os.path.join(checkpoint_dir, "plans")):
        raise InputError("show", f"{checkpoint_dir[:160]!r} is neither a plan file nor an elastic run's checkpoint "
                                 "directory (it has no plans/ folder)")
    return [(step, load_plan(path)) for step, path in plan_files(checkpoint_dir)]


def print_run(checkpoint_dir: str, console: Console | None = None) -> None:
    """The plans an elastic run ran under, one row each: from which step, on which hosts, in which shape."""
    console = console or Console(width=None if Console().is_terminal else 160)
    t = Table(title=f"elastic run in {checkpoint_dir}")
    for col in ("from step", "hosts", "ranks", "stages (device x width [layers])", "samples/s predicted"):
        t.add_column(col)
    for step, plan in run_plans(checkpoint_dir):
        hosts = sorted({r.host for st in plan.stages for r in st.replicas})
        shape = " | ".join(f"{'+'.join(st.types)} x{st.width} [{st.chunk_ranges[0][0]},{st.chunk_ranges[-1][1]})"
                           for st in plan.stages)
        rate = num(plan.predicted.samples_per_s) if plan.predicted else ""
        t.add_row(str(step), " ".join(hosts), str(plan.world_size), shape, rate)
    console.print(t)
