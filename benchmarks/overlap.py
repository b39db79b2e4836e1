"""Overlap benchmark: the bucketed gradient all-reduce against the blocking one, across a rate-limited link.

One stage of two replicas, one on each of two emulated hosts (network namespaces, hethub.emulated.netem), so
the data-parallel all-reduce crosses a link `tc` limits to RATE_MBIT each way (the cluster file says the same
rate). The same plan runs twice side by side: gradients in buckets of BUCKET_MB, each all-reduced as soon as the
last backward completes it, and in one bucket (the whole all-reduce starts after the last backward: blocking).
Exposed all-reduce = the seconds the schedule's AR action waits (rank 0, median over the steps after warm-up); the target is exposed <= 30% of blocking. Each iteration is measured (median after warm-up) and
predicted by the cost model, which models the same overlap (CostModel.allreduce_end_s), from profiles of
this CPU at the emulated speed. Needs root. Writes benchmarks/results/overlap.md.
Run: python benchmarks/overlap.py [--steps N]
"""
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from multihost import bench_setup, cluster_at, run_across  # noqa: E402
from runtime import write_result  # noqa: E402

from hethub.cli.profiler import profile_model  # noqa: E402
from hethub.partitioner import Cluster, ModelConfig  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.evaluate import predict  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan  # noqa: E402

MODEL = {"name": "gpt-overlap", "architecture": "gpt", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
         "ffn_hidden_size": 512, "vocab_size": 512, "seq_length": 64}
EMULATE = 30.0  # FAST = this CPU 30x slower: the ranks idle most of the time, the link is what is shared
RATE_MBIT = 100
BUCKET_MB = 0.25
MB, M = 8, 4  # 4 samples per replica per micro-batch


def one_per_host(rate_mbit: float) -> Cluster:
    c = cluster_at(rate_mbit)
    return c.model_copy(update={"nodes": [n.model_copy(update={"count": 1}) for n in c.nodes]})


def exposed_ar_s(out: str, warmup: int = 3) -> float:
    """Rank 0's median seconds in the AR action after warm-up (what the all-reduce left after the backward)."""
    with open(out) as f:
        log = json.load(f)["log"]
    return statistics.median(e["ar_s"] for e in log[warmup:])


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10
    model = ModelConfig.model_validate(MODEL)
    tmp, model_json = bench_setup(model, "overlap.py")
    # 15 repetitions: the emulation idles each layer to 30x the fastest time it has seen, and the run sees 40
    # micro-batches; 5 repetitions found a fastest time up to ~20% slower on a loaded machine (predicted +20%)
    profiles = [profile_model(model, "FAST", mb, "fp32", reps=15, slowdown=EMULATE, progress=False) for mb in (1, 2, 4)]
    cluster = one_per_host(RATE_MBIT)
    plan = build_plan(model, cluster, [StageLayout((0, model.num_planner_layers), "FAST", (MB // 2, MB // 2))], MB, M)
    grad_mib = 4 * CostModel(cluster, model, dtype="fp32").stage_params(0, model.num_planner_layers) / 2**20
    rows, got = [], {}
    for label, bucket_mb in (("bucketed", BUCKET_MB), ("one bucket (blocking)", 65536.0)):
        cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5, bucket_mb=bucket_mb)
        tag = f"o{bucket_mb:g}"
        meas = run_across(plan, RATE_MBIT, model_json, steps, tmp, tag, emulate=EMULATE,
                          extra=["--bucket-mb", str(bucket_mb)])
        pred = predict(plan, cm).iteration_s
        got[label] = (exposed_ar_s(os.path.join(tmp, f"{tag}-out.json")), meas, pred)
        rows.append(f"| {label} | {bucket_mb:g} | {got[label][0] * 1e3:.0f} | {meas * 1e3:.0f} | {pred * 1e3:.0f} | "
                    f"{pred / meas - 1:+.1%} |")
        print(rows[-1], flush=True)
    (ar_b, meas_b, pred_b), (ar_1, meas_1, pred_1) = got["bucketed"], got["one bucket (blocking)"]
    load = os.getloadavg()[0]
    text = "\n".join([
        "# Overlap benchmark: bucketed vs blocking gradient all-reduce across a rate-limited link", "",
        f"Model {model.name} ({model.num_layers} blocks, hidden {model.hidden_size}, seq {model.seq_length}), fp32, "
        f"{grad_mib:.1f} MiB of fp32 gradients, Adam. One stage of two replicas, one per emulated host "
        f"(network namespaces), FAST = this CPU emulated {EMULATE:g}x slower; the link limited to {RATE_MBIT} Mbit/s "
        f"each way (tc tbf) and priced at the same rate. Micro-batch {MB} ({MB // 2} samples per replica) x {M}. "
        f"Median of {steps - 3} iterations after 3 warm-up, the exposed all-reduce too (rank 0's AR "
        f"action). Load average at the end: {load:.2f} (2 cores).", "",
        "| gradients | bucket MiB | exposed all-reduce ms | measured ms/iteration | predicted ms/iteration | "
        "predicted vs measured |", "|---|---|---|---|---|---|", *rows, "",
        f"Exposed all-reduce, bucketed / blocking: **{ar_b / ar_1:.0%}** (target <= 30%). Iteration saved: measured "
        f"{(meas_1 - meas_b) * 1e3:.0f} ms, predicted {(pred_1 - pred_b) * 1e3:.0f} ms.", ""])
    write_result("overlap.md", text)


if __name__ == "__main__":
    main()
