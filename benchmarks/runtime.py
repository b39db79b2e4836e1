"""Runtime benchmark on the emulated 2-type cluster (hethub demo's: 2 FAST + 3 SLOW ranks), one run:

(a) hethub's plan vs vanilla DeepSpeed with its own `parameters` partition on the same ranks;
(b) hethub's engine on that same uniform layout vs vanilla DeepSpeed's engine (engine overhead);
(c) hethub plan: predicted (closed form, from profiles measured here) vs measured iteration time.
Median of the iterations after warm-up. Writes benchmarks/results/runtime.md.
Run: python benchmarks/runtime.py [--steps N]
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hethub.demo import DEMO_CLUSTER, DEMO_MODEL, FAST_SLOWDOWN, SLOWDOWN  # noqa: E402
from hethub.models import build_layers  # noqa: E402
from hethub.partitioner import Cluster, ModelConfig  # noqa: E402
from hethub.partitioner.api import make_plan  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.evaluate import predict  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan, even_split  # noqa: E402
from hethub.partitioner.planner import PlannerOptions  # noqa: E402
from hethub.profiler import profile_model  # noqa: E402

WORKER = os.path.join(ROOT, "benchmarks", "runtime_worker.py")
EMULATE = f"FAST={FAST_SLOWDOWN:g},SLOW={FAST_SLOWDOWN * SLOWDOWN:g}"


def run(world: int, args: list[str], out: str, port: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HETHUB_LOCAL="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world), "--master_port", str(port),
           WORKER, *args, "--out", out]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(args[:2])}):\n" + (r.stdout + r.stderr)[-3000:])
    with open(out) as f:
        return json.load(f)["median_s"]


def main():
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 12
    torch.set_num_threads(1)
    cluster, model = Cluster.model_validate(DEMO_CLUSTER), ModelConfig.model_validate(DEMO_MODEL)
    tmp = tempfile.mkdtemp(prefix="hethub-bench-")
    model_json = os.path.join(tmp, "model.json")
    with open(model_json, "w") as f:
        f.write(model.to_json())
    profiles = [profile_model(model, t, mb, "fp32", reps=7, slowdown=k, progress=False)
                for t, k in (("FAST", FAST_SLOWDOWN), ("SLOW", FAST_SLOWDOWN * SLOWDOWN)) for mb in (1, 2, 4, 8)]
    cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5)
    G = 16
    plan = make_plan(cluster, model, G, opts=PlannerOptions(time_limit_s=20, max_micro_batch_size=8), cost_model=cm,
                     with_homogeneous_sum=False)
    # DeepSpeed's own partition: 5 stages of width 1 (equal widths over 5 ranks), its partition_balanced
    from deepspeed.runtime import utils as ds_utils
    weights = [sum(p.numel() for p in l.parameters() if p.requires_grad) for l in build_layers(model)]
    S, b = 5, 2
    bounds = [int(x) for x in ds_utils.partition_balanced(weights=weights, num_parts=S)]
    types = [n.device_type for n in cluster.nodes for _ in range(n.count)]  # hostfile order: FAST, FAST, SLOW x3
    uniform = build_plan(model, cluster, [StageLayout((bounds[s], bounds[s + 1]), types[s], even_split(b, 1))
                                          for s in range(S)], b, G // b)
    paths = {}
    for name, p in (("plan", plan), ("uniform", uniform)):
        paths[name] = os.path.join(tmp, f"{name}.json")
        with open(paths[name], "w") as f:
            f.write(p.to_json())
    common = ["--model-json", model_json, "--emulate", EMULATE, "--steps", str(steps)]
    t_plan = run(plan.world_size, ["--mode", "hethub", "--hetero-plan", paths["plan"], *common],
                 os.path.join(tmp, "a.json"), 29701)
    t_uni = run(5, ["--mode", "hethub", "--hetero-plan", paths["uniform"], *common], os.path.join(tmp, "b.json"), 29702)
    t_ds = run(5, ["--mode", "deepspeed", "--stages", str(S), "--micro-batch", str(b), "--micro-batches", str(G // b),
                   "--rank-types", ",".join(types), *common], os.path.join(tmp, "c.json"), 29703)
    pred_plan = predict(plan, cm).iteration_s
    pred_uni = predict(uniform, cm).iteration_s
    rows = [
        f"| (a) hethub plan vs DeepSpeed `parameters` partition (5 x 1) | {t_plan * 1e3:.1f} ms vs {t_ds * 1e3:.1f} ms "
        f"| {t_ds / t_plan:.2f}x | >= 1.3x |",
        f"| (b) hethub engine vs DeepSpeed engine, same layout | {t_uni * 1e3:.1f} ms vs {t_ds * 1e3:.1f} ms | "
        f"{t_uni / t_ds - 1:+.1%} | within 5% |",
        f"| (c) hethub plan: predicted vs measured | {pred_plan * 1e3:.1f} ms vs {t_plan * 1e3:.1f} ms | "
        f"{pred_plan / t_plan - 1:+.1%} | within 10% |",
        f"| (c') uniform layout: predicted vs measured | {pred_uni * 1e3:.1f} ms vs {t_uni * 1e3:.1f} ms | "
        f"{pred_uni / t_uni - 1:+.1%} | |",
    ]
    layout = "; ".join(f"{s.device_type} x{s.width} layers [{s.layers[0]},{s.layers[1]})" for s in plan.stages)
    text = "\n".join([
        "# Runtime benchmark (emulated 2-type cluster on this 2-core CPU machine, gloo)", "",
        f"Model {model.name} ({model.num_layers} blocks, hidden {model.hidden_size}, seq {model.seq_length}); global "
        f"batch {G}; 2 FAST ranks (this CPU emulated {FAST_SLOWDOWN:g}x slower) + 3 SLOW ranks "
        f"({SLOWDOWN:g}x slower than FAST). Median of {steps - 3} iterations after 3 warm-up, Adam.", "",
        f"hethub plan: {layout}; micro-batch {plan.micro_batch_size} x {plan.num_micro_batches}.",
        f"DeepSpeed: PipelineModule(partition_method='parameters', num_stages=5), boundaries {bounds}, micro-batch "
        f"{b} x {G // b}.", "",
        "| comparison | times | result | target |", "|---|---|---|---|", *rows, ""])
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "runtime.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
