"""Multi-host benchmark: plans run across two emulated hosts whose link is rate-limited, measured side by side
with what the cost model predicts at that rate.

Two network namespaces (hethub.emulated.netem) are two hosts of two FAST ranks each (this CPU emulated FAST x slower);
`tc` limits their link, each way, to the rate of the row, and the cluster file says the same rate
(`inter_node_gbps`). One `hethub launch --no_ssh` per host.
(a) one hand-made plan, stage 0 on host A and stage 1 on host B, at each rate: measured vs predicted
    s/iteration, and the slow-down from the fastest rate, measured vs predicted;
(b) hethub's own plan at each rate (it sees the link): its layout, measured vs predicted.
Median of the iterations after warm-up. Needs root. Writes benchmarks/results/multihost.md.
Run: python benchmarks/multihost.py [--steps N]
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from runtime import FID_MODEL, write_result  # noqa: E402

from hethub.cli.demo import DEMO_CLUSTER  # noqa: E402
from hethub.emulated.netem import ADDRS, probe, two_hosts  # noqa: E402
from hethub.partitioner import Cluster, ModelConfig  # noqa: E402
from hethub.partitioner.api import make_plan  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.evaluate import predict  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan  # noqa: E402
from hethub.partitioner.planner import PlannerOptions  # noqa: E402
from hethub.cli.profiler import profile_model  # noqa: E402

WORKER = os.path.join(ROOT, "hethub", "cli", "bench_worker.py")
FAST = 6.0  # every rank idles 5/6 of its time: four ranks on two cores do not steal each other's cycles
RATES_MBIT = (1000, 25, 10, 5)
G = 32


def cluster_at(rate_mbit: float) -> Cluster:
    return Cluster.model_validate({
        "name": f"two-hosts-{rate_mbit:g}mbit", "device_types": {"FAST": DEMO_CLUSTER["device_types"]["FAST"]},
        "nodes": [{"host": ADDRS[0], "device_type": "FAST", "count": 2},
                  {"host": ADDRS[1], "device_type": "FAST", "count": 2}],
        "network": {"intra_node_gbps": 40, "inter_node_gbps": rate_mbit / 1000}})


def run_across(plan, rate_mbit: float, model_json: str, steps: int, tmp: str, tag: str, extra=(),
               emulate: float = None) -> float:
    """The plan on the hosts it uses (both, or one), one `hethub launch --no_ssh` each; median s/iteration.
    ``extra``: more bench_worker flags; ``emulate``: FAST's slow-down (default FAST)."""
    path, out = os.path.join(tmp, f"{tag}.json"), os.path.join(tmp, f"{tag}-out.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    hosts_used = sorted({r.host for st in plan.stages for r in st.replicas}, key=ADDRS.index)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    script = [WORKER, "--mode", "hethub", "--model-json", model_json, "--emulate", f"FAST={emulate or FAST:g}",
              "--steps", str(steps), "--out", out, *extra]
    with two_hosts(rate_mbit) as hosts:
        mine = [hosts[ADDRS.index(a)] for a in hosts_used]  # node k = the plan's k-th host
        procs = [subprocess.Popen(["ip", "netns", "exec", h.namespace, sys.executable, "-m", "hethub.cli", "launch",
                                   "--hetero-plan", path, "--no_ssh", "--master_addr", hosts_used[0], "--node_rank",
                                   str(k), *script], env=dict(env, GLOO_SOCKET_IFNAME=h.interface), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for k, h in enumerate(mine)]
        outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"run {tag} failed:\n" + "\n".join(o[-2000:] for o in outs))
    with open(out) as f:
        return json.load(f)["median_s"]


def bench_setup(model: ModelConfig, script: str) -> tuple[str, str]:
    """(scratch folder, model JSON in it) for a benchmark across emulated hosts; exits where none can be made."""
    if not probe()[0]:
        raise SystemExit(f"benchmarks/{script} needs root and iproute2 (network namespaces)")
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="hethub-bench-")
    model_json = os.path.join(tmp, "model.json")
    with open(model_json, "w") as f:
        f.write(model.to_json())
    return tmp, model_json


def layout(plan) -> str:
    return "; ".join(f"layers [{s.layers[0]},{s.layers[1]}) x{s.width} on "
                     f"{'A' if s.replicas[0].host == ADDRS[0] else 'B'}" for s in plan.stages) + \
        f"; {plan.micro_batch_size} x {plan.num_micro_batches}"


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10
    model = ModelConfig.model_validate(FID_MODEL)
    tmp, model_json = bench_setup(model, "multihost.py")
    profiles = [profile_model(model, "FAST", mb, "fp32", reps=5, slowdown=FAST, progress=False) for mb in (1, 2, 4, 8)]
    rows_a, rows_b, base = [], [], None
    for rate in RATES_MBIT:
        cluster = cluster_at(rate)
        cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5)
        fixed = build_plan(model, cluster, [StageLayout((0, 6), "FAST", (2, 2)), StageLayout((6, 12), "FAST", (2, 2))],
                           4, G // 4)
        pred, meas = predict(fixed, cm).iteration_s, run_across(fixed, rate, model_json, steps, tmp, f"a{rate}")
        base = base or (pred, meas)
        rows_a.append(f"| {rate} | {meas * 1e3:.0f} | {pred * 1e3:.0f} | {pred / meas - 1:+.1%} | "
                      f"{meas / base[1]:.2f}x | {pred / base[0]:.2f}x |")
        print(rows_a[-1], flush=True)
        own = make_plan(cluster, model, G, opts=PlannerOptions(time_limit_s=20, max_micro_batch_size=8,
                                                               max_tensor_parallel=1), cost_model=cm,
                        with_homogeneous_sum=False)
        own_pred, own_meas = predict(own, cm).iteration_s, run_across(own, rate, model_json, steps, tmp, f"b{rate}")
        rows_b.append(f"| {rate} | {layout(own)} | {own_meas * 1e3:.0f} | {own_pred * 1e3:.0f} | "
                      f"{own_pred / own_meas - 1:+.1%} | {meas / own_meas:.2f}x | {pred / own_pred:.2f}x |")
        print(rows_b[-1], flush=True)
    act_kib = 4 * model.seq_length * model.hidden_size * 4 / 1024
    text = "\n".join([
        "# Multi-host benchmark (two emulated hosts on this 2-core CPU machine, gloo over a rate-limited veth)", "",
        f"Model {model.name} ({model.num_layers} blocks, hidden {model.hidden_size}, seq {model.seq_length}), fp32, "
        f"global batch {G}, Adam. Two hosts A and B (network namespaces) of 2 FAST ranks each, FAST = this CPU "
        f"emulated {FAST:g}x slower; the link between them limited to the row's rate each way (tc tbf), and the "
        f"cluster's inter_node_gbps set to the same rate. A micro-batch of 4 sends {act_kib:.0f} KiB of "
        f"activations across (and the same in gradients back). Median of {steps - 3} iterations after 3 warm-up.",
        "", "## (a) The same plan across the link at each rate", "",
        f"Plan: {layout(fixed)}. Slow-down: this rate's iteration / the {RATES_MBIT[0]} Mbit/s one's.", "",
        "| link Mbit/s | measured ms | predicted ms | predicted vs measured | measured slow-down "
        "| predicted slow-down |", "|---|---|---|---|---|---|", *rows_a,
        "", "## (b) hethub's plan at each rate", "",
        "The planner prices the link. Speed-up over (a): (a)'s ms / this plan's ms, measured and predicted; below "
        "1x the planner's closed form ranked a plan first that its own replay (and the run) finds slower than (a)'s.",
        "", "| link Mbit/s | hethub's plan | measured ms | predicted ms | predicted vs measured | speed-up over (a) "
        "measured | speed-up over (a) predicted |", "|---|---|---|---|---|---|---|", *rows_b, ""])
    write_result("multihost.md", text)


if __name__ == "__main__":
    main()
