"""``hethub`` command line.

Every command: ``--help``; exit 0 on success; exit 2 with one line naming the
bad field or flag on bad input, never a traceback for a user error. Commands
that plan or show import no torch.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .._version import __version__
from ..partitioner.errors import InputError, print_error
from ..partitioner.outputs import check_output_path, write_atomic
from ..partitioner.records import MAX_BATCH, MAX_BLOCKS


def _int_in(lo: int, hi: int):
    """argparse type: an integer in [lo, hi] (bad values become one line naming the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {text[:40]}")
        return value
    return parse


def _float_in(lo: float, hi: float, lo_open: bool = False):
    """argparse type: a finite float in [lo, hi] ((lo, hi] with lo_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
        if not (lo < value <= hi if lo_open else lo <= value <= hi):  # nan fails both
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {text[:40]}")
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (``error: ...``) and exits 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        flag, sep, rest = message.partition(": ")
        if flag.startswith("argument ") and sep:  # "argument --x: problem" -> "--x: problem"
            raise InputError(flag[len("argument "):].split("/")[-1], rest)
        raise InputError("", f"{self.prog}: {message}")


def cmd_show(args: argparse.Namespace) -> int:
    from ..partitioner.records import load_plan
    from .show import print_plan
    print_plan(load_plan(args.plan))
    return 0


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
                f"incumbent {inc:.4g} s, bound {bound:.4g} s, gap {gap:.1%}, {s['elapsed_s']:.1f} s")
        if self.status:
            self.status.update(line)
        elif s["elapsed_s"] - self.last >= self.every_s:
            self.last = s["elapsed_s"]
            print(line, flush=True)


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..partitioner.api import BASELINES, make_baseline, make_plan
    from ..partitioner.costmodel import CostModel
    from ..partitioner.errors import InfeasibleError
    from ..partitioner.planner import PlannerOptions
    from ..partitioner.records import ModelConfig, load_cluster, load_model, load_profiles, parse_record
    from .show import print_plan

    cluster, model = load_cluster(args.cluster), load_model(args.model)
    if args.seq_length:
        model = parse_record(ModelConfig, {**model.model_dump(), "seq_length": args.seq_length}, "--seq-length")
    profile_files = ([os.path.join(args.profiles, f) for f in os.listdir(args.profiles)]
                     if args.profiles and os.path.isdir(args.profiles) else [])
    check_output_path(args.output, "--output", [args.cluster, args.model, *profile_files])
    sizes = None
    if args.micro_batch_sizes:
        try:
            sizes = tuple(int(x) for x in args.micro_batch_sizes.split(","))
        except ValueError:
            raise InputError("--micro-batch-sizes", f"expected integers like 4,8,16, got {args.micro_batch_sizes!r}")
    profiles = load_profiles(args.profiles) if args.profiles else ()
    cm = CostModel(cluster, model, profiles=profiles, memory_reserve_gib=args.memory_reserve_gib, zero1=args.zero1)
    opts = PlannerOptions(solver=args.solver, time_limit_s=args.time_limit, micro_batch_sizes=sizes,
                          max_micro_batch_size=args.max_micro_batch, allow_recompute=not args.no_recompute,
                          max_units=args.max_units, equal_widths=args.equal_widths,
                          max_tensor_parallel=args.max_tensor_parallel, mixed_types=not args.no_mixed_stages,
                          schedule=args.schedule, zero1_stages=not args.no_zero1_stages)
    console = Console(width=None if Console().is_terminal else 160)
    for note in cm.notes:
        console.print(f"note: {note}")
    if args.what_if:
        return _what_if(args, cm, opts, console)
    if args.baseline:
        plan = make_baseline(args.baseline, cluster, model, args.global_batch, opts=opts, cost_model=cm)
    else:
        with _SolveStatus(console) as status:
            plan = make_plan(cluster, model, args.global_batch, opts=opts, cost_model=cm,
                             with_homogeneous_sum=not args.no_compare, progress=status, objective=args.objective)
    write_atomic(args.output, plan.to_json() + "\n", "--output", [args.cluster, args.model, *profile_files])
    print_plan(plan, console)
    split = sorted({(s.device_type, s.tensor_parallel) for s in plan.stages
                    if s.tensor_parallel > 1 and not cm.tp_measured(s.device_type, s.tensor_parallel)})
    if profiles and split:  # no profile measured at that degree
        console.print("note: tensor parallel " + ", ".join(f"{t} x{k}" for t, k in split) + " priced analytically on "
                      "top of the t = 1 profiles (blocks' compute / t, plus their all-reduces on the intra-node link); "
                      "hethub profile --tensor-parallel T measures them")
    if not args.baseline and not args.no_compare:
        for kind in BASELINES:
            try:
                base = make_baseline(kind, cluster, model, args.global_batch, opts=opts, cost_model=cm)
                console.print(f"vs {kind}: {plan.predicted.samples_per_s / base.predicted.samples_per_s:.2f}x "
                              f"({base.predicted.samples_per_s:.4g} samples/s)")
            except InfeasibleError as exc:
                console.print(f"vs {kind}: baseline has no feasible plan ({exc.message})")
    if args.explain:
        from ..partitioner.api import solve
        from ..partitioner.explain import explain
        for line in explain(plan, cm, opts, solve):
            console.print(f"explain: {line}", soft_wrap=True)
    console.print(f"wrote {args.output}")
    return 0


def _what_if(args: argparse.Namespace, cm, opts, console) -> int:
    """Plan the cluster as it is and as changed, with the same options; print both, write nothing."""
    from ..partitioner.api import solve
    from ..partitioner.costmodel import CostModel
    from ..partitioner.errors import InfeasibleError
    from ..partitioner.whatif import apply_what_if
    changed = apply_what_if(cm.cluster, args.what_if)
    other = CostModel(changed, cm.model, profiles=[p for p in cm.profiles if p.device_type in changed.type_names],
                      memory_reserve_gib=cm.memory_reserve_gib, zero1=cm.zero1)
    results = []
    for label, model in (("now", cm), ("what-if", other)):
        try:
            plan = solve(model, args.global_batch, opts)
            results.append(plan.predicted.samples_per_s)
            console.print(f"{label}: {plan.predicted.samples_per_s:.4g} samples/s on {plan.world_size} of "
                          f"{model.cluster.num_devices} devices, {plan.num_stages} stages")
        except InfeasibleError as exc:
            results.append(0.0)
            console.print(f"{label}: no feasible plan ({exc.message})")
    before, after = results
    change = f"{after / before - 1:+.1%}" if before > 0 else "from infeasible"
    console.print(f"what-if {args.what_if!r}: {before:.4g} -> {after:.4g} samples/s ({change}); no plan written")
    return 0


TIMELINE_BUDGET = 1_000  # (rank, micro-batch) pairs drawn in a PNG or Chrome trace


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..partitioner.costmodel import CostModel
    from ..partitioner.evaluate import closed_form_s, replay_iteration_s, replay_micro_batches, with_micro_batches
    from ..partitioner.records import load_plan, load_profiles
    from ..partitioner.schedule import build_schedule, format_schedule, read_schedule_file
    from ..partitioner.simulator import simulate, write_png, write_trace

    plan = load_plan(args.plan)
    inputs = (args.plan, args.schedule)
    for path, flag in ((args.trace, "--trace"), (args.png, "--png")):
        if path:
            check_output_path(path, flag, inputs)
    cm = CostModel(plan.cluster, plan.model, profiles=load_profiles(args.profiles) if args.profiles else ())
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
    print(f"iteration {it * 1e3:.3f} ms, {plan.global_batch_size / it:.4g} samples/s, "
          f"bubble {res.bubble_fraction:.1%} ({pred}; closed form {closed_form_s(plan, cm) * 1e3:.3f} ms)")
    for st in plan.stages:
        print(f"stage {st.index} ({st.device_type}): busy " +
              ", ".join(f"r{r.rank} {res.busy[r.rank]:.0%}" for r in st.replicas))
    if (args.trace or args.png) and shown.world_size * shown.num_micro_batches > TIMELINE_BUDGET and not args.schedule:
        m_t = max(2 * plan.num_stages + 2, TIMELINE_BUDGET // plan.world_size)
        shown = with_micro_batches(plan, min(m_t, plan.num_micro_batches))
        res = simulate(shown, cm)
        print(f"note: the timeline shows the first {shown.num_micro_batches} of {plan.num_micro_batches} micro-batches")
    if args.trace:
        write_trace(res, shown, args.trace, inputs)
        print(f"wrote {args.trace}")
    if args.png:
        write_png(res, shown, args.png, inputs=inputs)
        print(f"wrote {args.png}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..partitioner.megatron_export import export_megatron
    from ..partitioner.records import load_plan
    ex = export_megatron(load_plan(args.plan))
    print(" \\\n".join(ex.flags()))
    print(f"# data-parallel size {ex.data_parallel_size} (world = {ex.pipeline_model_parallel_size} x "
          f"{ex.data_parallel_size}); per-rank micro-batch {ex.micro_batch_size}")
    if ex.first_last:
        print(f"# megatron-core without pipeline_model_parallel_layout: --decoder-first-pipeline-num-layers "
              f"{ex.first_last[0]} --decoder-last-pipeline-num-layers {ex.first_last[1]}")
    print("# launch ranks in this order (Megatron's rank order tp-cp-ep-dp-pp: rank r runs stage r // DP):")
    for r, s, j, host, slot, dtype in ex.rank_order:
        print(f"#   rank {r}: stage {s} replica {j} -> {host}:{slot} ({dtype})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(args.output_dir, args.steps, args.global_batch)


def cmd_profile(args: argparse.Namespace) -> int:
    from ..partitioner.records import load_model
    model = load_model(args.model)
    check_output_path(args.output, "--output")
    import torch

    from .profile import measure_links, profile_model
    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    prof = profile_model(model, args.device_type, args.micro_batch_size, dtype, reps=args.reps,
                         slowdown=args.emulate_slowdown, progress=os.environ.get("RANK", "0") == "0",
                         tensor_parallel=args.tensor_parallel)
    if args.links:
        from ..partitioner.records import LinkProfile
        prof = prof.model_copy(update={"links": [LinkProfile(**d) for d in measure_links()]})
    if os.environ.get("RANK", "0") == "0":
        write_atomic(args.output, prof.to_json() + "\n", "--output")
        block = next((l for l in prof.layers if l.kind == "block"), prof.layers[0])
        tp = f", tensor parallel {prof.tensor_parallel}" if prof.tensor_parallel > 1 else ""
        print(f"wrote {args.output}: {len(prof.layers)} layers of {model.name} on {args.device_type} "
              f"(micro-batch {prof.micro_batch_size}, {dtype}{tp}); block forward {block.forward_ms:.3f} ms, "
              f"backward {block.backward_ms:.3f} ms" + (f", {len(prof.links)} links" if prof.links else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hethub", description="Plan and run DeepSpeed pipeline training across a heterogeneous "
                                           "GPU fleet.")
    p.add_argument("--version", action="version", version=f"hethub {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    sp = sub.add_parser("plan", help="plan stages, widths and sample splits for a cluster and model")
    sp.add_argument("--cluster", required=True, help="cluster YAML/JSON")
    sp.add_argument("--model", required=True, help="model YAML/JSON, a built-in name (gpt-1.3b, llama-7b, ...) or "
                                                    "hf:path/config.json (GPT-2, Llama, Mistral, Qwen2)")
    sp.add_argument("--seq-length", type=_int_in(1, 10_000_000), default=None,
                    help="train at this sequence length (default: the model's; a Hugging Face config's maximum)")
    sp.add_argument("--global-batch", type=_int_in(1, MAX_BATCH), required=True, help="samples per iteration")
    sp.add_argument("-o", "--output", default="plan.json")
    sp.add_argument("--profiles", help="directory of measured profile JSON files")
    sp.add_argument("--solver", choices=["highs", "cbc", "brute-force"], default="highs")
    sp.add_argument("--time-limit", type=_float_in(0, 86400, lo_open=True), default=60.0,
                    help="solver time limit, seconds (brute force too)")
    sp.add_argument("--baseline", choices=["uniform", "parameters", "fastest-only"],
                    help="plan the way a baseline would, for comparison")
    sp.add_argument("--micro-batch-sizes", help="comma-separated micro-batch sizes to consider "
                                                 "(default: divisors of the global batch up to --max-micro-batch)")
    sp.add_argument("--max-micro-batch", type=_int_in(1, MAX_BATCH), default=64)
    sp.add_argument("--no-recompute", action="store_true", help="never plan activation recompute")
    sp.add_argument("--memory-reserve-gib", type=_float_in(0, 1e6), default=2.0, help="kept free on every device")
    sp.add_argument("--zero1", action="store_true", help="shard optimizer state over each stage's replicas")
    sp.add_argument("--max-units", type=_int_in(3, MAX_BLOCKS + 2), default=None,
                    help="group blocks into at most this many cut points (default: every layer is one)")
    sp.add_argument("--max-tensor-parallel", type=_int_in(1, 1024), default=8,
                    help="largest tensor-parallel degree a stage may use (1, 2, 4, 8 within one node; 1: off)")
    sp.add_argument("--no-zero1-stages", action="store_true",
                    help="never shard one stage's optimizer state alone (default: a stage may use ZeRO-1 where that "
                         "lets it hold more micro-batches in flight; --zero1 shards every stage)")
    sp.add_argument("--no-mixed-stages", action="store_true",
                    help="one device type per stage (default: a stage may mix two types of one vendor, "
                         "speed-proportional splits)")
    sp.add_argument("--schedule", choices=["1f1b", "zb-h1"], default="1f1b",
                    help="pipeline schedule the plan runs: 1f1b (default), or zb-h1, which sends each input gradient "
                         "before computing the weights' (1F1B's memory but one micro-batch more on the last stage)")
    sp.add_argument("--equal-widths", action="store_true",
                    help="every stage the same width and even splits: plans Megatron-core can run")
    sp.add_argument("--no-compare", action="store_true", help="skip the baselines and homogeneous sub-cluster "
                                                               "plans (faster)")
    sp.add_argument("--objective", choices=["throughput", "cost"], default="throughput",
                    help="cost: fewest dollars per million tokens (needs usd_per_hour for every device type)")
    sp.add_argument("--explain", action="store_true",
                    help="say for each idle device type which constraint keeps it out and what would bring it in")
    sp.add_argument("--what-if", metavar="CHANGE",
                    help="'add 16 V100-32GB', 'remove 8 A100-80GB', 'remove host nv3' (';' joins several): print "
                         "the change in samples/s; no plan is written")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("simulate", help="event-level replay of one iteration of a plan")
    sp.add_argument("plan")
    sp.add_argument("--trace", help="write a Chrome trace JSON")
    sp.add_argument("--png", help="write a timeline PNG")
    sp.add_argument("--profiles", help="directory of measured profile JSON files")
    sp.add_argument("--schedule", help="replay this schedule file instead of the plan's 1F1B "
                                       "(one line per rank: `RANK: action action ...`)")
    sp.add_argument("--print-schedule", action="store_true", help="print each rank's actions")
    sp.set_defaults(func=cmd_simulate)

    sp = sub.add_parser("export", help="print what another framework needs to run a plan (megatron)")
    sp.add_argument("target", choices=["megatron"])
    sp.add_argument("plan")
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("show", help="human summary of a plan")
    sp.add_argument("plan", help="plan JSON")
    sp.set_defaults(func=cmd_show)

    sp = sub.add_parser("profile", help="measure per-layer time and memory on the local device")
    sp.add_argument("--model", required=True)
    sp.add_argument("--device-type", required=True)
    sp.add_argument("--micro-batch-size", type=_int_in(1, 1 << 16), default=1)
    sp.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                    help="default: bf16 on a GPU, fp32 on CPU")
    sp.add_argument("--reps", type=_int_in(1, 10_000), default=7,
                    help="timed repetitions per layer (median), after 2 warm-ups")
    sp.add_argument("--emulate-slowdown", type=_float_in(1, 1e4), default=1.0, metavar="K",
                    help="profile as if the device were K times slower (emulated heterogeneity)")
    sp.add_argument("--links", action="store_true", help="measure link bandwidth between ranks (under a launcher)")
    sp.add_argument("--tensor-parallel", type=_int_in(1, 1024), default=1, metavar="T",
                    help="split the block over T processes (under a launcher with T of them, one node) so its "
                         "times include the tensor-parallel all-reduces")
    sp.add_argument("-o", "--output", default="profile.json")
    sp.set_defaults(func=cmd_profile)

    sub.add_parser("launch", help="run a training script under a plan with DeepSpeed's launcher: "
                                  "hethub launch --hetero-plan plan.json [--local] [deepspeed flags] train.py [args]",
                   add_help=False)

    sp = sub.add_parser("demo", help="plan a built-in mixed cluster, then train hethub's plan, the FAST-only plan and "
                                     "DeepSpeed's partition on it side by side (CPU, gloo)")
    sp.add_argument("--steps", type=_int_in(2, 1000), default=6, help="iterations per run (three runs)")
    sp.add_argument("--global-batch", type=_int_in(1, 4096), default=64)
    sp.add_argument("-o", "--output-dir", default="demo-out")
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["launch"]:  # DeepSpeed's flags pass through unparsed: see hethub.launch
            from .launch import parse_launch_args, run
            plan, local, dry, rest = parse_launch_args(argv[1:])
            return run(plan, rest, local=local, dry_run=dry)
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return 0
        return int(args.func(args) or 0)
    except InputError as exc:
        print_error(str(exc))
        return 2
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130

