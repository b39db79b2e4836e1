"""ZeRO-1 and mixed-type stages on the emulated 2-type cluster, one run, numbers side by side:

(a) optimizer-state bytes per rank with and without ZeRO-1 (Adam, fp32): measured (sum of each rank's state
    tensors after the run) vs ``CostModel.optimizer_state_bytes``, and what a parameter-granular split (whole
    tensors to the least-loaded replica, as ``torch.distributed.optim.ZeroRedundancyOptimizer`` does) would
    give the fullest replica; iteration time with and without ZeRO-1, predicted vs measured;
(b) one mixed stage (3 FAST + 3 SLOW replicas, speed-proportional split 3:1) vs two single-type stages
    (FAST x3 then SLOW x3, layers cut by speed) on the same six ranks and global batch: measured and
    predicted iteration time of both.
Median of the iterations after warm-up. Writes benchmarks/results/zero_mixed.md.
Run: python benchmarks/zero_mixed.py [--steps N]
"""
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from runtime import FID_CLUSTER, FID_FAST, FID_MODEL, FID_SLOW, run, write_result  # noqa: E402

from hethub.models.builtin import build_layers  # noqa: E402
from hethub.partitioner import Cluster, ModelConfig, Plan  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.evaluate import predict  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan  # noqa: E402
from hethub.cli.profiler import profile_model  # noqa: E402

EMULATE = f"FAST={FID_FAST:g},SLOW={FID_SLOW:g}"


def parameter_granular_max(sizes: list[int], width: int) -> int:
    """Elements on the fullest replica when whole tensors go, largest first, to the least-loaded replica."""
    loads = [0] * width
    for n in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += n
    return max(loads)


def mixed_stage_plan(model, cluster) -> Plan:
    """One stage over the whole model: 3 FAST replicas with 3 samples each, 3 SLOW replicas with 1."""
    base = build_plan(model, cluster, [StageLayout((0, model.num_planner_layers), "FAST", (3, 3, 3, 1, 1, 1))], 12, 4)
    data = json.loads(base.to_json())
    for k, rep in enumerate(data["stages"][0]["replicas"][3:]):
        rep.update({"host": "slow-node", "slot": k, "device_type": "SLOW"})
    return Plan.model_validate(data)


def write(tmp: str, name: str, plan: Plan) -> str:
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    return path


def main():
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10
    torch.set_num_threads(1)
    cluster, model = Cluster.model_validate(FID_CLUSTER), ModelConfig.model_validate(FID_MODEL)
    tmp = tempfile.mkdtemp(prefix="hethub-zero-")
    model_json = os.path.join(tmp, "model.json")
    with open(model_json, "w") as f:
        f.write(model.to_json())
    profiles = [profile_model(model, t, mb, "fp32", reps=5, slowdown=k, progress=False)
                for t, k in (("FAST", FID_FAST), ("SLOW", FID_SLOW)) for mb in (1, 2, 3, 4)]
    common = ["--model-json", model_json, "--emulate", EMULATE, "--steps", str(steps)]
    sizes = [[p.numel() for p in layer.parameters()] for layer in build_layers(model)]

    # (a) ZeRO-1: a 2-stage plan, widths 2 and 3
    plan = build_plan(model, cluster, [StageLayout((0, 8), "FAST", (3, 3)), StageLayout((8, 12), "SLOW", (2, 2, 2))], 6, 8)
    path = write(tmp, "zero", plan)
    rows, times = [], {}
    for z in (False, True):
        state = os.path.join(tmp, f"state-{z}")
        flags = ["--zero1"] if z else []
        times[z] = run(plan.world_size, ["--mode", "hethub", "--hetero-plan", path, *common, *flags, "--state-out", state],
                       os.path.join(tmp, f"zero-{z}.json"), 29730 + z)
        cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5, zero1=z)
        for st in plan.stages:
            figure = cm.optimizer_state_bytes(*st.layers, st.width)
            n = sum(sum(sizes[i]) for i in range(*st.layers))
            granular = parameter_granular_max([s for i in range(*st.layers) for s in sizes[i]], st.width) * 8
            for r in st.replicas:
                with open(f"{state}.{r.rank}") as f:
                    got = json.load(f)["opt_bytes"]
                rows.append(f"| {'ZeRO-1' if z else 'none'} | {st.index} ({st.width} x {st.device_type}) | {r.rank} | "
                            f"{got / 2**20:.3f} | {figure / 2**20:.3f} | {figure / got - 1:+.2%} | "
                            f"{(granular / 2**20) if z and st.width > 1 else n * 8 / 2**20:.3f} |")
        times[z] = (times[z], predict(plan, cm).iteration_s)
    # (b) mixed stage vs two single-type stages, same six ranks, global batch 48
    cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5)
    layouts = {
        "two single-type stages: FAST x3 layers [0,9), SLOW x3 [9,12), micro-batch 6 x 8":
            build_plan(model, cluster, [StageLayout((0, 9), "FAST", (2, 2, 2)), StageLayout((9, 12), "SLOW", (2, 2, 2))],
                       6, 8),
        "one mixed stage: 3 FAST (3 samples each) + 3 SLOW (1 each), micro-batch 12 x 4": mixed_stage_plan(model, cluster),
    }
    mixed_rows = []
    for k, (name, p) in enumerate(layouts.items()):
        measured = run(p.world_size, ["--mode", "hethub", "--hetero-plan", write(tmp, f"mixed{k}", p), *common],
                       os.path.join(tmp, f"mixed{k}.json"), 29740 + k)
        pred = predict(p, cm).iteration_s
        mixed_rows.append(f"| {name} | {measured * 1e3:.0f} | {pred * 1e3:.0f} | {pred / measured - 1:+.1%} |")
        print(mixed_rows[-1], flush=True)
    zrows = [f"| {'ZeRO-1' if z else 'none'} | {m * 1e3:.0f} | {p * 1e3:.0f} | {p / m - 1:+.1%} |"
             for z, (m, p) in times.items()]
    text = "\n".join([
        "# ZeRO-1 and mixed-type stages (emulated 2-type cluster on this 2-core CPU machine, gloo)", "",
        f"Model {model.name} ({model.num_layers} blocks, hidden {model.hidden_size}, seq {model.seq_length}), Adam in "
        f"fp32 (8 bytes of state per parameter). FAST ranks emulated {FID_FAST:g}x slower than this CPU, SLOW "
        f"{FID_SLOW:g}x. Median of {steps - 3} iterations after 3 warm-up; profiles measured in this run.", "",
        "## (a) Optimizer-state bytes per rank (2 stages: FAST x2 layers [0,8), SLOW x3 layers [8,12))", "",
        "Measured = sum of the rank's optimizer state tensors. Figure = `CostModel.optimizer_state_bytes` (what the "
        "memory model charges). Last column: without ZeRO-1 the unsharded state; with it, the fullest replica "
        "under a parameter-granular split (`ZeroRedundancyOptimizer`'s rule), for comparison. Target: within 5%.", "",
        "| ZeRO | stage | rank | measured MiB | figure MiB | figure vs measured | unsharded / parameter-granular MiB |",
        "|---|---|---|---|---|---|---|", *rows, "",
        "| ZeRO | measured ms/iteration | predicted ms | predicted vs measured |", "|---|---|---|---|", *zrows, "",
        "## (b) A mixed stage vs two single-type stages on the same 6 ranks, global batch 48", "",
        "| layout | measured ms/iteration | predicted ms | predicted vs measured |", "|---|---|---|---|", *mixed_rows, ""])
    write_result("zero_mixed.md", text)


if __name__ == "__main__":
    main()
