"""Chunked schedules run on the emulated cluster, side by side with 1F1B, one run, numbers side by side:

for two of runtime.py's (d) plans (4 stages of width 1; widths 1/2/1/2) and a balanced 4-stage pipeline whose fill
is most of its iteration (M = 4), each run under 1F1B, zb-h1 (one chunk per group, the backward split: its memory
is priced the way zb-v's is), interleaved-1f1b (v = 2; 3 on the balanced one) and zb-v,
the groups and sample splits unchanged (``chunked.rechunk`` re-cuts each group's layers by
time, and zb-v orders its passes by their times, as ``hethub plan --schedule`` does):
- measured vs predicted iteration time (``hethub simulate``'s number), target within 10%;
- measured vs predicted speed-up over the same plan's 1F1B, target within 10% of the predicted speed-up;
- per rank, the most activation bytes autograd held at once during the timed steps vs the cost model's peak
  (``evaluate.activation_peak_bytes``), target within 10%.
Every plan runs twice: pinned (each emulated layer takes its profiled time, ``hethub.emulated.pinned``: the
measured number) and self-calibrated (k x the fastest real time each rank sees, the column beside it).
Median of the iterations after warm-up. Writes benchmarks/results/chunked.md.
Run: python benchmarks/chunked.py [--steps N]
"""
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime import (FID_FAST, FID_PLANS, FID_SLOW, PINNED_NOTE, fidelity_setup, measured_note,  # noqa: E402
                     profiles_dir, run, write_result)
from hethub.partitioner.chunked import rechunk  # noqa: E402
from hethub.partitioner.evaluate import activation_peak_bytes, chunk_time_s, predict, with_pass_times  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan  # noqa: E402

# (name, micro-batch size, micro-batches, [(layers, type, samples per replica)], chunked variants)
PLANS = [(*p, [("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2)]) for p in FID_PLANS
         if p[0] in ("4 stages, width 1 each", "4 stages, widths 1/2/1/2")]
# few micro-batches for the depth: the fill is most of 1F1B's iteration, what chunking exists to cut
PLANS.append(("4 FAST stages of 3 layers, M = 4", 2, 4, [((3 * s, 3 * s + 3), "FAST", (2,)) for s in range(4)],
              [("zb-h1", 1), ("interleaved-1f1b", 3), ("zb-v", 2)]))


def main():
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 8
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="hethub-bench-chunked-")
    cluster, model, model_json, cm = fidelity_setup(tmp)
    rows, mem_rows, port = [], [], 29760
    for name, b, M, stages, variants in PLANS:
        base = build_plan(model, cluster, [StageLayout(l, t, s) for l, t, s in stages], b, M)
        first = {}
        for schedule, v in [("1f1b", 1), *variants]:
            plan = with_pass_times(rechunk(base, schedule, v, chunk_time_s(base, cm)), cm)  # zb-v: ordered by time
            tag = f"{len(rows)}"
            path, mem = os.path.join(tmp, f"plan-{tag}.json"), os.path.join(tmp, f"mem-{tag}")
            with open(path, "w") as f:
                f.write(plan.to_json())
            args = ["--mode", "hethub", "--hetero-plan", path, "--model-json", model_json,
                    "--emulate", f"FAST={FID_FAST:g},SLOW={FID_SLOW:g}", "--steps", str(steps), "--memory-out", mem]
            measured = run(plan.world_size, args, os.path.join(tmp, f"out-{tag}.json"), port, pinned=profiles_dir(tmp))
            measured_self = run(plan.world_size, args[:-2], os.path.join(tmp, f"self-{tag}.json"), port + 1)
            port += 2
            predicted = predict(plan, cm).iteration_s
            first.setdefault("m", measured)
            first.setdefault("p", predicted)
            chunks = " ".join(f"[{c.first},{c.last})" for c in plan.pipeline)
            rows.append(f"| {name} | {b} x {M} | {schedule} | {chunks} | {measured * 1e3:.0f} | {predicted * 1e3:.0f} | "
                        f"{predicted / measured - 1:+.1%} | {first['m'] / measured:.3f}x | "
                        f"{first['p'] / predicted:.3f}x | {(first['m'] / measured) / (first['p'] / predicted) - 1:+.1%} | "
                        f"{measured_self * 1e3:.0f} | {predicted / measured_self - 1:+.1%} |")
            print(rows[-1], flush=True)
            for s, st in enumerate(plan.stages):
                for rep in st.replicas:
                    with open(f"{mem}.{rep.rank}") as f:
                        held = json.load(f)["activation_peak_bytes"]
                    pred = activation_peak_bytes(plan, cm, s, rep.samples)
                    mem_rows.append(f"| {name} | {schedule} | {s} | {rep.rank} | {rep.samples} | {held / 2**20:.2f} | "
                                    f"{pred / 2**20:.2f} | {pred / held - 1:+.1%} |")
    text = "\n".join([
        "# Chunked schedules on the emulated cluster (benchmarks/chunked.py)", "",
        f"Model {model.name} ({model.num_layers} blocks, hidden {model.hidden_size}, seq {model.seq_length}); FAST "
        f"ranks emulated {FID_FAST:g}x slower than this CPU, SLOW {FID_SLOW:g}x; profiles at micro-batch 1/2/4 "
        f"measured in this run. {measured_note(cluster)} fp32, Adam, gloo over the strict-order transport. Median of {steps - 3} iterations "
        f"after 3 warm-up. Each plan keeps its groups, widths and splits; chunked variants re-cut each group's layers "
        f"by time (`hethub plan --schedule`'s re-cut). Speed-up = the same plan's 1F1B ms / this schedule's ms.", "",
        PINNED_NOTE, "",
        "| plan | micro-batch x M | schedule | chunks (pipeline order) | measured ms | predicted ms | "
        "predicted vs measured | measured speed-up | predicted speed-up | speed-up: measured vs predicted | "
        "self-calibrated ms | predicted vs self-calibrated |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        "## Activation memory: what autograd held at its peak vs the cost model", "",
        "Held = the most bytes of tensors saved for backward, and of tensors a split backward's weight pass waits "
        "with, alive at once during the timed steps (counted as `hethub profile` counts a layer's activation "
        "bytes); predicted = `evaluate.activation_peak_bytes` (each chunk-micro-batch held from its forward to "
        "its backward; from a split B to its W, what the W waits with).", "",
        "| plan | schedule | group | rank | rows | held MiB | predicted MiB | predicted vs held |",
        "|---|---|---|---|---|---|---|---|", *mem_rows, ""])
    write_result("chunked.md", text)


if __name__ == "__main__":
    main()
