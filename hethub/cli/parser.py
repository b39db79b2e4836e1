"""The ``hethub`` command line's parser: one function per command, flags checked as they are parsed.

A bad flag is one line naming it (``_Parser.error`` raises ``InputError``), exit 2, never argparse's usage text.
"""
from __future__ import annotations

import argparse

from .._version import __version__
from ..partitioner.errors import InputError
from ..partitioner.baselines import BASELINES
from ..partitioner.options import AUTO, MAX_TIME_LIMIT_S, SOLVERS, PlannerOptions
from ..partitioner.records import MAX_BATCH, MAX_BLOCKS, SCHEDULES


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


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command but ``launch``'s flags (DeepSpeed's pass through: ``hethub.cli.launch``).
    Each command names the module and function that run it (``run``), imported only when that command runs."""
    p = _Parser(prog="hethub", description="Plan and run DeepSpeed pipeline training across a heterogeneous "
                                           "GPU fleet.")
    p.add_argument("--version", action="version", version=f"hethub {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_plan(sub)
    _add_simulate(sub)
    _add_export(sub)
    _add_show(sub)
    _add_profile(sub)
    _add_launch(sub)
    _add_demo(sub)
    return p


def _add_plan(sub) -> None:
    sp = sub.add_parser("plan", help="plan stages, widths and sample splits for a cluster and model")
    sp.add_argument("--cluster", required=True, help="cluster YAML/JSON")
    sp.add_argument("--model", required=True, help="model YAML/JSON, a built-in name (gpt-1.3b, llama-7b, ...) or "
                                                    "hf:path/config.json (GPT-2, Llama, Mistral, Qwen2)")
    sp.add_argument("--seq-length", type=_int_in(1, 10_000_000), default=None,
                    help="train at this sequence length (default: the model's; a Hugging Face config's maximum)")
    sp.add_argument("--global-batch", type=_int_in(1, MAX_BATCH), required=True, help="samples per iteration")
    sp.add_argument("-o", "--output", default="plan.json")
    sp.add_argument("--profiles", help="directory of measured profile JSON files")
    sp.add_argument("--solver", choices=SOLVERS, default=PlannerOptions.solver)
    sp.add_argument("--time-limit", type=_float_in(0, MAX_TIME_LIMIT_S, lo_open=True),
                    default=PlannerOptions.time_limit_s,
                    help="solver time limit, seconds (brute force too)")
    sp.add_argument("--baseline", choices=list(BASELINES),
                    help="plan the way a baseline would, for comparison")
    sp.add_argument("--micro-batch-sizes", help="comma-separated micro-batch sizes to consider "
                                                 "(default: divisors of the global batch up to --max-micro-batch)")
    sp.add_argument("--max-micro-batch", type=_int_in(1, MAX_BATCH), default=PlannerOptions.max_micro_batch_size)
    sp.add_argument("--no-recompute", action="store_true", help="never plan activation recompute")
    sp.add_argument("--memory-reserve-gib", type=_float_in(0, 1e6), default=2.0, help="kept free on every device")
    sp.add_argument("--zero1", action="store_true", help="shard optimizer state over each stage's replicas")
    sp.add_argument("--max-units", type=_int_in(3, MAX_BLOCKS + 2), default=None,
                    help="group blocks into at most this many cut points (default: every layer is one)")
    sp.add_argument("--max-tensor-parallel", type=_int_in(1, 1024), default=PlannerOptions.max_tensor_parallel,
                    help="largest tensor-parallel degree a stage may use (1, 2, 4, 8 within one node; 1: off)")
    sp.add_argument("--no-zero1-stages", action="store_true",
                    help="never shard one stage's optimizer state alone (default: a stage may use ZeRO-1 where that "
                         "lets it hold more micro-batches in flight; --zero1 shards every stage)")
    sp.add_argument("--no-mixed-stages", action="store_true",
                    help="one device type per stage (default: a stage may mix two types of one vendor, "
                         "speed-proportional splits)")
    sp.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                    help="training precision the plan is priced in and records (default auto: bf16 where every "
                         "device type has it, else fp16 with dynamic loss scaling, else fp32)")
    sp.add_argument("--schedule", choices=[*SCHEDULES, AUTO], default=AUTO,
                    help="pipeline schedule the plan runs: auto (default: the fastest of all of them that fits "
                         "memory, groups planned for zb-h1); 1f1b; zb-h1, which sends each input gradient before "
                         "computing the weights' (1F1B's memory but one micro-batch more on the last stage); "
                         "interleaved-1f1b (each group holds v = 2..4 chunks, the fastest kept) or zb-v (two chunks "
                         "in a V, the backward split as zb-h1's)")
    sp.add_argument("--network", choices=["overlap", "no-overlap"], default="overlap",
                    help="the network model plans are priced and chosen by: overlap (default: the runtime's; "
                         "transfers overlap compute, the all-reduce hides behind the last backward) or no-overlap "
                         "(as Sailor's simulator: transfers on the compute's path, the whole all-reduce after the "
                         "last backward), for a plan robust to a fleet whose network overlaps less")
    sp.add_argument("--equal-widths", action="store_true",
                    help="every stage the same width, even splits, each device type in one run of stages: "
                         "plans Megatron-core can run")
    sp.add_argument("--no-compare", action="store_true", help="skip the baselines and homogeneous sub-cluster "
                                                               "plans (faster)")
    sp.add_argument("--objective", choices=["throughput", "cost"], default="throughput",
                    help="cost: fewest dollars per million tokens (needs usd_per_hour for every device type)")
    sp.add_argument("--explain", action="store_true",
                    help="say for each idle device type which constraint keeps it out and what would bring it in")
    sp.add_argument("--what-if", metavar="CHANGE",
                    help="'add 16 V100-32GB', 'remove 8 A100-80GB', 'remove host nv3' (';' joins several): print "
                         "the change in samples/s; no plan is written")
    sp.set_defaults(run="plan:cmd_plan")


def _add_simulate(sub) -> None:
    sp = sub.add_parser("simulate", help="event-level replay of one iteration of a plan")
    sp.add_argument("plan")
    sp.add_argument("--trace", help="write a Chrome trace JSON")
    sp.add_argument("--png", help="write a timeline PNG")
    sp.add_argument("--profiles", help="directory of measured profile JSON files")
    sp.add_argument("--schedule", help="replay this schedule file instead of the plan's 1F1B "
                                       "(one line per rank: `RANK: action action ...`)")
    sp.add_argument("--print-schedule", action="store_true", help="print each rank's actions")
    sp.set_defaults(run="simulate:cmd_simulate")


def _add_export(sub) -> None:
    sp = sub.add_parser("export", help="megatron: print what Megatron needs to run a plan; hf: write a checkpoint "
                                       "as a Hugging Face folder")
    sp.add_argument("target", choices=["megatron", "hf"])
    sp.add_argument("plan", metavar="PLAN|CHECKPOINT_DIR", help="megatron: plan.json; hf: a hethub checkpoint folder")
    sp.add_argument("--model", help="hf: the model's folder (hf:FOLDER), whose config.json the checkpoint trained")
    sp.add_argument("-o", "--out", help="hf: the folder to write (must not exist)")
    sp.add_argument("--tag", help="hf: the checkpoint's tag (default: the newest complete one)")
    sp.set_defaults(run="export:cmd_export")


def _add_show(sub) -> None:
    sp = sub.add_parser("show", help="human summary of a plan, or of the plans an elastic run ran under")
    sp.add_argument("plan", help="plan JSON, or an elastic run's checkpoint directory (its plans/step-<k>.json)")
    sp.set_defaults(run="show:cmd_show")


def _add_profile(sub) -> None:
    sp = sub.add_parser("profile", help="measure per-layer time and memory on the local device: a model hethub "
                                        "describes (--model), or the layers a training script builds (--script)")
    which = sp.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a model file or built-in name (gpt, llama)")
    which.add_argument("--script", help="a training script (DeepSpeed's or hethub's), run until its first step; its "
                                        "arguments follow --; writes -o DIR/model.json and DIR/<device type>.json")
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
    sp.add_argument("-o", "--output", default=None, help="the profile (default profile.json); with --script, a "
                                                        "folder")
    sp.add_argument("script_args", nargs=argparse.REMAINDER, help="with --script: the script's arguments, after --")
    sp.set_defaults(run="profile_script:cmd_profile")


def _add_launch(sub) -> None:
    # parsed by hethub.cli.launch (DeepSpeed's flags pass through): listed here for --help
    sub.add_parser("launch", help="run a training script under a plan with DeepSpeed's launcher: "
                                  "hethub launch --hetero-plan plan.json [--local] [deepspeed flags] train.py [args]",
                   add_help=False)


def _add_demo(sub) -> None:
    sp = sub.add_parser("demo", help="plan a built-in mixed cluster, then train hethub's plan, the FAST-only plan and "
                                     "DeepSpeed's partition on it side by side (CPU, gloo)")
    sp.add_argument("--steps", type=_int_in(2, 1000), default=6, help="iterations per run (three runs)")
    sp.add_argument("--global-batch", type=_int_in(1, 4096), default=64)
    sp.add_argument("-o", "--output-dir", default="demo-out")
    sp.set_defaults(run="demo:cmd_demo")
