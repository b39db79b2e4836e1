"""Elastic training's costs, one run, numbers side by side:

(a) the re-plan a restart runs (``hethub.runtime.elastic.replan``, 2 s budget): 8 A100 + 8 V100 (gpt-1.3b, global
    batch 128) and what is left when either host is lost; target <= 2 s for 16 devices;
(b) checkpointing every 10 steps by the engine itself on the demo's model and cluster (6 emulated ranks): step
    times without, with background writes and with writes at the step, side by side; target <= 5% of the step.
The loss -> first step and return -> first step times of a real two-host run are measured by
tests/test_multihost.py (test_elastic_launch_loses_a_host_replans_and_grows_back), not here.
Writes benchmarks/results/elastic.md.
Run: python benchmarks/elastic.py [--steps N]
"""
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime import EMULATE, run, write_result  # noqa: E402
from hethub.cli.demo import DEMO_CLUSTER, DEMO_MODEL  # noqa: E402
from hethub.partitioner import Cluster, ModelConfig  # noqa: E402
from hethub.partitioner.api import make_plan  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.planner import PlannerOptions  # noqa: E402
from hethub.partitioner.records import builtin_model  # noqa: E402
from hethub.runtime.elastic import replan, sub_cluster  # noqa: E402

TWO_TYPE = {"name": "a100-v100", "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 8},
                                           {"host": "v", "device_type": "V100-32GB", "count": 8}],
            "network": {"intra_node_gbps": 2400, "inter_node_gbps": 200}}
EVERY = 10


def replan_rows() -> list[str]:
    cluster, model = Cluster.model_validate(TWO_TYPE), builtin_model("gpt-1.3b")
    base = make_plan(cluster, model, 128, opts=PlannerOptions(time_limit_s=10), with_homogeneous_sum=False,
                     cost_model=CostModel(cluster, model, dtype="fp16"))
    rows = []
    for present in (["a", "v"], ["a"], ["v"]):
        ranks = [(n.host, k) for n in cluster.nodes if n.host in present for k in range(n.count)]
        sub = sub_cluster(cluster, ranks)
        t0 = time.perf_counter()
        plan = replan(base, sub)
        took = time.perf_counter() - t0
        rows.append(f"| {' + '.join(f'{n.count} {n.device_type}' for n in sub.nodes)} | {took:.2f} | "
                    f"{plan.world_size} | {plan.num_stages} | {plan.predicted.samples_per_s:.3g} | "
                    f"{plan.solver.status}, gap {plan.solver.gap or 0:.2%} |")
        print(rows[-1], flush=True)
    return rows


RUNS = [("no checkpoints", []), (f"every {EVERY} steps, in the background", ["--checkpoint-every", str(EVERY)]),
        (f"every {EVERY} steps, at the step", ["--checkpoint-every", str(EVERY), "--checkpoint-at-step"])]


def checkpoint_rows(steps: int, tmp: str) -> tuple[list[str], dict]:
    """The demo's model and cluster, one run per row, interleaved twice (the machine's load drifts); each row's
    median step over both, the first step of each run left out (one-time costs in all)."""
    cluster, model = Cluster.model_validate(DEMO_CLUSTER), ModelConfig.model_validate(DEMO_MODEL)
    plan = make_plan(cluster, model, 32, opts=PlannerOptions(time_limit_s=10, max_tensor_parallel=1),
                     with_homogeneous_sum=False, cost_model=CostModel(cluster, model, dtype="fp32"))
    paths = {"plan": os.path.join(tmp, "plan.json"), "model": os.path.join(tmp, "model.json")}
    with open(paths["plan"], "w") as f:
        f.write(plan.to_json())
    with open(paths["model"], "w") as f:
        f.write(model.to_json())
    times: dict[str, list[float]] = {name: [] for name, _ in RUNS}
    saving: dict[str, list[float]] = {name: [] for name, _ in RUNS}
    for rep in range(2):
        for k, (name, extra) in enumerate(RUNS):
            out = os.path.join(tmp, f"out-{rep}-{k}.json")
            ck = ["--checkpoint-dir", os.path.join(tmp, f"ck-{rep}-{k}")] if extra else []
            run(plan.world_size, ["--mode", "hethub", "--hetero-plan", paths["plan"], "--model-json", paths["model"],
                                  "--emulate", EMULATE, "--steps", str(steps), "--warmup", "0", *ck, *extra], out,
                29850 + 3 * rep + k)
            with open(out) as f:
                run_times = json.load(f)["times"]
            times[name] += run_times[1:]
            # the step that saves (index EVERY-1, 2*EVERY-1, ...) and the one after (a background write's end)
            saving[name] += [run_times[i] + run_times[i + 1] - 2 * statistics.median(run_times[1:])
                             for i in range(EVERY - 1, len(run_times) - 1, EVERY)]
    med = {name: statistics.median(t) for name, t in times.items()}
    mean = {name: statistics.mean(t) for name, t in times.items()}
    costs = {name: (mean[name] - mean[RUNS[0][0]]) / mean[RUNS[0][0]] for name, _ in RUNS}
    rows = [f"| {name} | {med[name] * 1e3:.0f} | {mean[name] * 1e3:.0f} | {costs[name]:+.1%} | "
            f"{statistics.median(saving[name]) * 1e3:+.0f} | {len(times[name])} |" for name, _ in RUNS]
    return rows, {name: costs[name] for name, _ in RUNS[1:]}


def main():
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 21
    tmp = tempfile.mkdtemp(prefix="hethub-bench-elastic-")
    rows = replan_rows()
    ck_rows, costs = checkpoint_rows(steps, tmp)
    load = os.getloadavg()[0]
    text = "\n".join([
        "# Elastic training's costs (benchmarks/elastic.py)", "",
        "## (a) The re-plan at a restart", "",
        "gpt-1.3b, global batch 128, fp16; the job's plan for 8 A100-80GB + 8 V100-32GB, then each restart's re-plan "
        "(`hethub.runtime.elastic.replan`: the planner with a 2 s budget) for the hosts present. Target: <= 2 s for 16 "
        "devices.", "",
        "| devices present | re-plan s | ranks | stages | samples/s predicted | solver |", "|---|---|---|---|---|---|",
        *rows, "",
        f"## (b) Checkpoints every {EVERY} steps, written by the engine itself", "",
        f"The demo's model and cluster (2 FAST + 4 SLOW ranks, emulated), fp32, Adam; {steps} steps a run, each run "
        f"twice, interleaved; step times after each run's first (the steps that save included as they come: the "
        f"mean carries their cost, the median mostly not); load average {load:.2f} at the end (2 cores). Target: "
        f"<= 5% of the step.", "",
        "The save column: the step that saves plus the one after (where a background write completes), over "
        "twice the run's median step, median over the saves (the run without checkpoints: the same steps).", "",
        "| run | median ms/step | mean ms/step | mean vs none | save ms | steps |", "|---|---|---|---|---|---|",
        *ck_rows, "",
        *[f"Checkpoint cost {name}: **{cost:+.1%}** of the step." for name, cost in costs.items()], ""])
    write_result("elastic.md", text)


if __name__ == "__main__":
    main()
