"""``hethub demo``: plan a built-in mixed cluster and train on it, emulated on this machine.

The cluster: 2 "FAST" ranks and 3 "SLOW" ranks (3x slower: each SLOW layer idles twice its compute
time, see hethub.emulation). Steps: profile the model on this CPU (FAST) and under the emulated
slowdown (SLOW); plan with those profiles; launch examples/train_gpt.py through ``hethub launch
--local`` (DeepSpeed's launcher, gloo); print the loss curve and measured vs predicted iteration
time; write the simulator's timeline.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from rich.console import Console

from .partitioner.records import Cluster, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOWDOWN = 3.0  # SLOW vs FAST
# FAST ranks are emulated too (2x slower than this CPU): every rank then idles part of its time, so five
# ranks on two cores do not steal each other's cycles and the measured time can be compared with the plan.
FAST_SLOWDOWN = 2.0
# Nominal peaks only scale the analytic fallback; the profiles measured here set the real speeds.
DEMO_CLUSTER = {
    "name": "demo-emulated",
    "device_types": {
        "FAST": {"vendor": "cpu", "peak_tflops": {"fp32": 0.2}, "memory_gib": 8, "memory_gbps": 20},
        "SLOW": {"vendor": "cpu", "peak_tflops": {"fp32": 0.2 / SLOWDOWN}, "memory_gib": 8, "memory_gbps": 20},
    },
    "nodes": [{"host": "fast-node", "device_type": "FAST", "count": 2},
              {"host": "slow-node", "device_type": "SLOW", "count": 3}],
    "network": {"intra_node_gbps": 40, "inter_node_gbps": 10},
}
DEMO_MODEL = {"name": "gpt-demo", "architecture": "gpt", "num_layers": 6, "hidden_size": 192,
              "num_attention_heads": 4, "ffn_hidden_size": 768, "vocab_size": 512, "seq_length": 64}


def sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    return "".join(bars[int((v - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for v in values)


def run_demo(out_dir: str = "demo-out", steps: int = 20, global_batch: int = 16, timeout_s: float = 600) -> int:
    import torch

    from .partitioner.api import make_plan
    from .partitioner.costmodel import CostModel
    from .partitioner.planner import PlannerOptions
    from .partitioner.simulator import simulate, write_png
    from .profiler import profile_model
    from .show import print_plan

    console = Console(width=None if Console().is_terminal else 160)
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    cluster = Cluster.model_validate(DEMO_CLUSTER)
    model = ModelConfig.model_validate(DEMO_MODEL)
    console.print(f"[bold]hethub demo[/bold]: {model.name} on {cluster.name} "
                  f"(2 FAST + 3 SLOW ranks, SLOW emulated {SLOWDOWN:g}x slower), global batch {global_batch}")

    t0 = time.perf_counter()
    # several micro-batch sizes per type: the cost model fits fixed + per-sample time per layer
    profiles = [profile_model(model, t, mb, "fp32", reps=5, slowdown=k, progress=False)
                for t, k in (("FAST", FAST_SLOWDOWN), ("SLOW", FAST_SLOWDOWN * SLOWDOWN)) for mb in (1, 2, 4, 8)]
    for p in profiles:
        with open(os.path.join(out_dir, f"profile-{p.device_type}-mb{p.micro_batch_size}.json"), "w") as f:
            f.write(p.to_json())
    block = [p.layers[1] for p in profiles if p.micro_batch_size == 2]
    console.print(f"profiled in {time.perf_counter() - t0:.1f} s: block fwd+bwd "
                  f"FAST {block[0].forward_ms + block[0].backward_ms:.2f} ms, "
                  f"SLOW {block[1].forward_ms + block[1].backward_ms:.2f} ms (micro-batch 2)")

    cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5)
    plan = make_plan(cluster, model, global_batch, opts=PlannerOptions(time_limit_s=20, max_micro_batch_size=8),
                     cost_model=cm)
    plan_path = os.path.join(out_dir, "plan.json")
    with open(plan_path, "w") as f:
        f.write(plan.to_json() + "\n")
    print_plan(plan, console)
    sim = simulate(plan, cm)
    png = os.path.join(out_dir, "timeline.png")
    write_png(sim, plan, png)

    log_path = os.path.join(out_dir, "train-log.json")
    cmd = [sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", plan_path, "--local",
           os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", str(steps), "--emulate", f"FAST={FAST_SLOWDOWN:g},SLOW={FAST_SLOWDOWN * SLOWDOWN:g}",
           "--log-json", log_path]
    console.print(f"launching {plan.world_size} ranks: {' '.join(cmd[2:])}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    t1 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        console.print(f"error: training did not finish within {timeout_s:.0f} s")
        return 1
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        console.print(f"error: training exited with {proc.returncode}:\n{tail}")
        return proc.returncode or 1
    with open(log_path) as f:
        log = json.load(f)
    losses = [e["loss"] for e in log]
    warm = log[3:] if len(log) > 5 else log
    measured = statistics.median(e["seconds"] for e in warm)
    predicted = plan.predicted.iteration_s
    console.print(f"trained {len(log)} steps in {time.perf_counter() - t1:.1f} s (start-up included)")
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}  {sparkline(losses)}")
    console.print(f"iteration time: measured {measured * 1e3:.1f} ms (median after warm-up), predicted "
                  f"{predicted * 1e3:.1f} ms (closed form, {predicted / measured - 1:+.0%}), simulated "
                  f"{sim.iteration_s * 1e3:.1f} ms ({sim.iteration_s / measured - 1:+.0%})")
    console.print(f"wrote {plan_path}, {png}, {log_path}")
    if not losses[-1] < losses[0]:
        console.print("error: the loss did not fall")
        return 1
    return 0
