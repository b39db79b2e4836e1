"""A model hethub has never seen, end to end on an emulated two-type cluster: predicted vs measured iteration.

A DeepSpeed pipeline script (a small CNN, ``PipelineModule`` of ``LayerSpec``s with in-place ReLUs, trained from
``training_data`` with ``train_batch()``, as DeepSpeed's tutorial writes it) is profiled as two emulated device
types (``hethub profile --script``, FAST at 4x and SLOW at 8x this CPU's time), planned on a cluster of one FAST
and two SLOW ranks whose link latency and optimizer bandwidth are measured on this machine
(``emulated_cluster.measured``), and launched unchanged under the plan with each emulated layer pinned to its
profiled time (``HETHUB_EMULATE_PROFILES``). Median iteration of the steps after warm-up, against the plan's
prediction. Writes benchmarks/results/measured_model.md.

Run: python benchmarks/measured_model.py [--steps N]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
from emulated_cluster import measured  # noqa: E402
from results_io import write_result  # noqa: E402

SLOWDOWN = {"FAST": 4.0, "SLOW": 8.0}
MICRO_BATCH, GLOBAL_BATCH = 8, 64
CPU = {"vendor": "cpu", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20}
CLUSTER = {"name": "measured-cnn", "device_types": {"FAST": CPU, "SLOW": CPU},
           "nodes": [{"host": "localhost", "device_type": "FAST", "count": 1},
                     {"host": "localhost", "device_type": "SLOW", "count": 2}],
           "network": {"intra_node_gbps": 10, "inter_node_gbps": 10}}

SCRIPT = '''
import argparse, json, os, statistics, time
import deepspeed, torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn
from torch.utils.data import TensorDataset

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 3, 32, 32, generator=g), torch.randint(0, 10, (512,), generator=g))
    specs = [LayerSpec(nn.Conv2d, 3, 32, 3, padding=1), LayerSpec(nn.ReLU, inplace=True),
             LayerSpec(nn.Conv2d, 32, 32, 3, padding=1), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.MaxPool2d, 2),
             LayerSpec(nn.Conv2d, 32, 64, 3, padding=1), LayerSpec(nn.ReLU, inplace=True),
             LayerSpec(nn.Conv2d, 64, 64, 3, padding=1), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.MaxPool2d, 2),
             LayerSpec(nn.Flatten), LayerSpec(nn.Linear, 4096, 256), LayerSpec(nn.ReLU, inplace=True),
             LayerSpec(nn.Linear, 256, 10)]
    net = PipelineModule(layers=specs, loss_fn=nn.CrossEntropyLoss(), num_stages=2)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, training_data=data)
    from hethub.runtime.activations import ActivationMeter  # the benchmark's instrument, not the script's
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        engine.train_batch()
        times.append(time.perf_counter() - t0)
    meter = ActivationMeter(engine.module.parameters())
    with meter:  # one more step, its activations metered (untimed: the hooks cost host time)
        engine.train_batch()
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump({"activation_peak_bytes": meter.peak}, f)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times_s": times}, f)

if __name__ == "__main__":
    main()
'''


def sh(cmd, env=None, timeout=900):
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd[:6])}\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout


def memory_rows(name: str, plan_path: str, prof: str, out: str) -> list[str]:
    """Per rank of the plan: the activation peak it held against the cost model's."""
    from hethub.partitioner.costmodel import cost_model_for
    from hethub.partitioner.evaluate import activation_peak_bytes
    from hethub.partitioner.records import load_plan, load_profiles
    plan = load_plan(plan_path)
    cm = cost_model_for(plan, load_profiles(prof))
    rows = []
    for st in plan.stages:
        for rep in st.replicas:
            with open(f"{out}.{rep.rank}") as f:
                held = json.load(f)["activation_peak_bytes"]
            pred = activation_peak_bytes(plan, cm, st.index, rep.samples)
            rows.append(f"| {name} | {rep.rank} | {pred / 2**20:.2f} | {held / 2**20:.2f} | {held / pred:.3f} |")
    return rows


def pipelined_plan(tmp: str, cluster_path: str, prof: str) -> str:
    """A two-stage plan of the measured model (FAST first, the two SLOW ranks after it, 4+4), priced by the same
    cost model: the pipeline's transfers and schedule measured too (the planner's own plan is data-parallel)."""
    from hethub.partitioner import Cluster
    from hethub.partitioner.costmodel import CostModel
    from hethub.partitioner.evaluate import predict
    from hethub.partitioner.loaders import load_model
    from hethub.partitioner.placement import StageLayout, build_plan
    from hethub.partitioner.records import load_profiles
    with open(cluster_path) as f:
        cluster = Cluster.model_validate(json.load(f))
    model = load_model(os.path.join(prof, "model.json"))
    cm = CostModel(cluster, model, dtype="fp32", profiles=load_profiles(prof))
    plan = build_plan(model, cluster, [StageLayout((0, 6), "FAST", (MICRO_BATCH,)),
                                       StageLayout((6, 14), "SLOW", (MICRO_BATCH // 2, MICRO_BATCH // 2))],
                      MICRO_BATCH, GLOBAL_BATCH // MICRO_BATCH, dtype="fp32")
    plan = plan.model_copy(update={"predicted": predict(plan, cm)})
    path = os.path.join(tmp, "pipelined.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hethub-measured-")
    script, cfg = os.path.join(tmp, "cnn.py"), os.path.join(tmp, "ds.json")
    with open(script, "w") as f:
        f.write(SCRIPT)
    with open(cfg, "w") as f:
        json.dump({"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO_BATCH,
                   "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    prof = os.path.join(tmp, "prof")
    for t, k in SLOWDOWN.items():
        sh([sys.executable, "-m", "hethub.cli", "profile", "--script", script, "--device-type", t, "--emulate-slowdown",
            str(k), "--micro-batch-size", str(MICRO_BATCH // 2), "-o", prof, "--", "--out", os.devnull, "--deepspeed_config",
            cfg], env)
    cluster = os.path.join(tmp, "cluster.json")
    with open(cluster, "w") as f:
        json.dump(measured(CLUSTER, 3), f)
    plan = os.path.join(tmp, "plan.json")
    shown = sh([sys.executable, "-m", "hethub.cli", "plan", "--cluster", cluster, "--model",
                os.path.join(prof, "model.json"), "--profiles", prof, "--global-batch", str(GLOBAL_BATCH),
                "--micro-batch-sizes", str(MICRO_BATCH), "--time-limit", "20", "-o", plan], env)
    run_env = dict(env, HETHUB_EMULATE_SLOWDOWN=",".join(f"{t}={k:g}" for t, k in SLOWDOWN.items()),
                   HETHUB_EMULATE_PROFILES=prof)
    rows, memory = [], []
    for name, path in (("the planner's plan", plan), ("a pipeline: FAST [0, 6) -> SLOW x2 [6, 14)",
                                                       pipelined_plan(tmp, cluster, prof))):
        out = os.path.join(tmp, "times.json")
        sh([sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", path, "--local", script, "--out", out,
            "--steps", str(a.steps), "--deepspeed_config", cfg], run_env)
        with open(out) as f:
            times = sorted(json.load(f)["times_s"][a.warmup:])
        with open(path) as f:
            predicted = json.load(f)["predicted"]["iteration_s"]
        median = times[len(times) // 2]
        rows.append(f"| {name} | {predicted * 1e3:.1f} | {median * 1e3:.1f} | {median / predicted:.3f} |")
        memory += memory_rows(name, path, prof, out)
    table = "\n".join(l for l in shown.splitlines() if l.startswith(("┃", "│")))
    text = (f"# A measured model on an emulated two-type cluster (benchmarks/measured_model.py)\n\n"
            f"One run, load average {os.getloadavg()[0]:.1f} at the end. A 14-layer CNN DeepSpeed script, profiled by "
            f"`hethub profile --script` as FAST (4x this CPU) and SLOW (8x), planned for 1 FAST + 2 SLOW ranks, "
            f"launched unchanged with every emulated layer pinned to its profile. Global batch {GLOBAL_BATCH}, "
            f"micro-batch {MICRO_BATCH}; median of {len(times)} steps after {a.warmup} warm-up.\n\n"
            f"```\n{table}\n```\n\n"
            f"| plan | predicted ms | measured ms (median) | measured / predicted |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n\n"
            "Activation memory: what autograd held at its peak on each rank (`ActivationMeter` over one more step) "
            "against the cost model's `evaluate.activation_peak_bytes` for that replica (from the measured "
            "activation bytes).\n\n| plan | rank | predicted MiB | held MiB | held / predicted |\n|---|---|---|---|---|\n"
            + "\n".join(memory) + "\n")
    write_result("measured_model.md", text)


if __name__ == "__main__":
    main()
