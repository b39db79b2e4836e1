"""Runtime benchmark on emulated heterogeneous clusters, one run, numbers side by side:

(a) hethub's plan vs vanilla DeepSpeed with its own `parameters` partition on the same ranks (demo cluster);
(b) hethub's engine on that same layout vs vanilla DeepSpeed's engine (engine overhead);
(c) hethub plan: predicted vs measured iteration time;
(d) schedule fidelity: hand-made plans of 2, 4 and 6 stages, equal and alternating widths, M from 8 to 24,
    each measured, simulated (= predicted) and compared with decoupled 1F1B from the same profiles,
    (M - 1) * max_s c_s + sum_s c_s with c_s the slowest replica's forward + backward;
(e) the same plans under schedule zb-h1: measured and predicted speed-up over 1F1B.
Every measurement runs twice: pinned (each emulated layer takes the time the run's profiles give it,
``hethub.emulated.pinned``) and self-calibrated (k x the fastest real time each rank sees).
Median of the iterations after warm-up. Writes benchmarks/results/runtime.md.
Run: python benchmarks/runtime.py [--steps N] [--only-fidelity]
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hethub.cli.demo import DEMO_CLUSTER, DEMO_MODEL, FAST_SLOWDOWN, SLOWDOWN  # noqa: E402
from hethub.models.builtin import build_layers  # noqa: E402
from hethub.partitioner import Cluster, ModelConfig  # noqa: E402
from hethub.partitioner.api import make_plan  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.evaluate import predict  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan, even_split  # noqa: E402
from hethub.partitioner.planner import PlannerOptions  # noqa: E402
from hethub.cli.profiler import profile_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated_cluster import measured  # noqa: E402

WORKER = os.path.join(ROOT, "hethub", "cli", "bench_worker.py")
EMULATE = f"FAST={FAST_SLOWDOWN:g},SLOW={FAST_SLOWDOWN * SLOWDOWN:g}"


def write_result(name: str, text: str) -> None:
    """benchmarks/results/NAME (and the same text on stdout)."""
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        f.write(text)
    print(text)


def run(world: int, args: list[str], out: str, port: int, pinned: str = "") -> float:
    """The median iteration of a bench_worker launch; ``pinned``: the emulated layers take the times of the
    profiles in that folder (``HETHUB_EMULATE_PROFILES``), not k x their fastest real time."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HETHUB_LOCAL="1", PYTHONPATH=ROOT,
               HETHUB_EMULATE_PROFILES=pinned)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world), "--master_port", str(port),
           WORKER, *args, "--out", out]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(args[:2])}):\n" + (r.stdout + r.stderr)[-3000:])
    with open(out) as f:
        return json.load(f)["median_s"]


# (d): every rank idles most of its time (FAST 6x slower than this CPU, SLOW 3x slower still), so that up to
# nine ranks on two cores do not steal each other's cycles.
FID_FAST, FID_SLOW = 6.0, 18.0
FID_MODEL = {"name": "gpt-bench", "architecture": "gpt", "num_layers": 10, "hidden_size": 192,
             "num_attention_heads": 4, "ffn_hidden_size": 768, "vocab_size": 512, "seq_length": 64}
FID_CLUSTER = {**DEMO_CLUSTER, "name": "bench-emulated",
               "nodes": [{"host": "fast-node", "device_type": "FAST", "count": 6},
                         {"host": "slow-node", "device_type": "SLOW", "count": 6}]}
# (name, micro-batch size, micro-batches, [(layers, type, samples per replica)])
FID_PLANS = [
    ("2 stages, widths 2/3", 6, 8, [((0, 8), "FAST", (3, 3)), ((8, 12), "SLOW", (2, 2, 2))]),
    ("4 stages, width 1 each", 2, 16, [((0, 4), "FAST", (2,)), ((4, 6), "SLOW", (2,)), ((6, 10), "FAST", (2,)),
                                       ((10, 12), "SLOW", (2,))]),
    ("4 stages, widths 1/2/1/2", 4, 8, [((0, 4), "FAST", (4,)), ((4, 6), "SLOW", (2, 2)), ((6, 10), "FAST", (4,)),
                                        ((10, 12), "SLOW", (2, 2))]),
    ("6 stages, width 1 each", 2, 8, [((2 * s, 2 * s + 2), "FAST", (2,)) for s in range(6)]),
    ("6 stages, widths 1/2/1/2/1/2", 2, 24, [((2 * s, 2 * s + 2), "FAST" if s % 2 == 0 else "SLOW",
                                             (2,) if s % 2 == 0 else (1, 1)) for s in range(6)]),
]

FID_WORLD = max(sum(len(shares) for *_, shares in stages) for *_, stages in FID_PLANS)  # the most ranks of one


def stage_types(stage) -> str:
    """"FAST x2 + SLOW x4": a stage's replicas by device type (a mixed stage names each of its types)."""
    counts = {}
    for rep in stage.replicas:
        counts[stage.type_of(rep)] = counts.get(stage.type_of(rep), 0) + 1
    return " + ".join(f"{t} x{n}" for t, n in counts.items())


def measured_note(cluster) -> str:
    """What the emulated cluster's file says that this run measured (``emulated_cluster.measured``)."""
    gbps = {t.memory_gbps for t in cluster.device_types.values()}
    return (f"Measured now and written in the cluster, which the predictions price (`benchmarks/emulated_cluster.py`): "
            f"link latency {cluster.network.intra_node_latency_us:.0f} us (gloo over loopback through the runtime's lane "
            f"threads), optimizer memory bandwidth {min(gbps):.1f} GB/s (every rank stepping Adam at once on this "
            f"machine's cores, as after a pipeline's last backward).")


def profiles_dir(tmp: str) -> str:
    """Where ``fidelity_setup`` writes the profiles pinned runs read."""
    return os.path.join(tmp, "profiles")


PINNED_NOTE = (
    "Measured: each emulated layer pinned to its profiled time (`HETHUB_EMULATE_PROFILES`: a layer's forward, "
    "backward and weight pass end when the cost model built from this run's profiles says; `hethub.emulated.pinned`), "
    "so a run measures the schedule, the transfers and the runtime's overhead over the same per-layer times the "
    "prediction uses. Self-calibrated: the same plan run again with each layer idling to k x the fastest real time "
    "that rank has seen of it, which up to nine ranks sharing two cores push 10-25% above the profile's; that "
    "difference, not the schedule, is most of its error.")


def decoupled_1f1b_s(plan, cm) -> float:
    """(M - 1) max c + sum c, c_s = forward + backward of the stage's largest share (compute only)."""
    c = [max(sum(cm.stage_compute_s(st.device_type, *st.layers, r.samples, st.recompute)) for r in st.replicas)
         for st in plan.stages]
    return (plan.num_micro_batches - 1) * max(c) + sum(c)


def fidelity_setup(tmp: str):
    """(cluster, model, model file, cost model from profiles measured now) of the (d) plans' emulated cluster, its
    link latency and optimizer bandwidth measured now (``emulated_cluster``); the profiles are written to ``TMP/profiles``, where pinned runs
    read them."""
    cluster = Cluster.model_validate(measured(FID_CLUSTER, FID_WORLD))
    model = ModelConfig.model_validate(FID_MODEL)
    model_json = os.path.join(tmp, "fid-model.json")
    with open(model_json, "w") as f:
        f.write(model.to_json())
    profiles = [profile_model(model, t, mb, "fp32", reps=5, slowdown=k, progress=False)
                for t, k in (("FAST", FID_FAST), ("SLOW", FID_SLOW)) for mb in (1, 2, 4)]
    os.makedirs(profiles_dir(tmp), exist_ok=True)
    for p in profiles:  # what pinned runs take their layers' times from
        with open(os.path.join(profiles_dir(tmp), f"{p.device_type}-mb{p.micro_batch_size}.json"), "w") as f:
            f.write(p.to_json())
    return cluster, model, model_json, CostModel(cluster, model, dtype="fp32", profiles=profiles,
                                                 memory_reserve_gib=0.5)


def fidelity(steps: int, tmp: str) -> list[str]:
    cluster, model, model_json, cm = fidelity_setup(tmp)
    rows, zb_rows = [], []

    def measure(plan, tag: str, port: int) -> tuple[float, float]:
        """(pinned, self-calibrated) median iteration seconds."""
        path = os.path.join(tmp, f"fid-{tag}.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        args = ["--mode", "hethub", "--hetero-plan", path, "--model-json", model_json,
                "--emulate", f"FAST={FID_FAST:g},SLOW={FID_SLOW:g}", "--steps", str(steps)]
        return (run(plan.world_size, args, os.path.join(tmp, f"fid-{tag}-out.json"), port, pinned=profiles_dir(tmp)),
                run(plan.world_size, args, os.path.join(tmp, f"fid-{tag}-self.json"), port + 50))

    for k, (name, b, M, stages) in enumerate(FID_PLANS):
        plan = build_plan(model, cluster, [StageLayout(l, t, s) for l, t, s in stages], b, M)
        measured, measured_self = measure(plan, f"{k}", 29710 + k)
        zb = plan.model_copy(update={"schedule": "zb-h1"})
        (measured_zb, measured_zb_self), pred_zb = measure(zb, f"{k}-zb", 29730 + k), predict(zb, cm).iteration_s
        pred = predict(plan, cm)
        zb_rows.append(f"| {name} | {b} x {M} | {measured * 1e3:.0f} | {measured_zb * 1e3:.0f} | "
                       f"{measured / measured_zb:.3f}x | {pred.iteration_s / pred_zb:.3f}x | {pred_zb * 1e3:.0f} | "
                       f"{pred_zb / measured_zb - 1:+.1%} | {measured_zb_self * 1e3:.0f} | "
                       f"{pred_zb / measured_zb_self - 1:+.1%} |")
        print(zb_rows[-1], flush=True)
        bound = decoupled_1f1b_s(plan, cm)
        rows.append(f"| {name} | {plan.world_size} | {b} x {M} | {measured * 1e3:.0f} | {bound * 1e3:.0f} | "
                    f"{measured / bound:.2f}x | {pred.iteration_s * 1e3:.0f} | {pred.iteration_s / measured - 1:+.1%} | "
                    f"{pred.model_extra['closed_form_s'] * 1e3:.0f} | "
                    f"{pred.model_extra['closed_form_s'] / measured - 1:+.1%} | {measured_self * 1e3:.0f} | "
                    f"{pred.iteration_s / measured_self - 1:+.1%} |")
        print(rows[-1], flush=True)
    return ["", "## (d) Schedule fidelity: measured vs decoupled 1F1B vs predicted", "",
            f"Model {model.name} ({model.num_layers} blocks, hidden {model.hidden_size}, seq {model.seq_length}); FAST "
            f"ranks emulated {FID_FAST:g}x slower than this CPU, SLOW {FID_SLOW:g}x; profiles at micro-batch 1/2/4 "
            f"measured in this run. {measured_note(cluster)} Predicted = `hethub simulate` (the same number); closed form = the MILP's "
            f"objective (which leaves out the iteration's control all-reduces). "
            f"Targets: measured <= 1.15x decoupled 1F1B, predicted within 10% of measured.", "",
            PINNED_NOTE, "",
            "| plan | ranks | micro-batch x M | measured ms | decoupled 1F1B ms | measured / 1F1B | predicted ms "
            "| predicted vs measured | closed form ms | closed form vs measured | self-calibrated ms "
            "| predicted vs self-calibrated |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
            "## (e) Schedule zb-h1 vs 1F1B: the same plans, measured side by side", "",
            "Each plan run twice in this benchmark, once per schedule (the emulation slows the weight pass as it "
            "slows a whole backward). Speed-up = 1F1B ms / zb-h1 ms.", "",
            "| plan | micro-batch x M | 1F1B measured ms | zb-h1 measured ms | measured speed-up | predicted speed-up "
            "| zb-h1 predicted ms | zb-h1 predicted vs measured | zb-h1 self-calibrated ms "
            "| predicted vs self-calibrated |", "|---|---|---|---|---|---|---|---|---|---|", *zb_rows]


def main():
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 12
    torch.set_num_threads(1)
    if "--only-fidelity" in sys.argv:
        print("\n".join(fidelity(steps, tempfile.mkdtemp(prefix="hethub-bench-"))))
        return
    cluster = Cluster.model_validate(measured(DEMO_CLUSTER, sum(n["count"] for n in DEMO_CLUSTER["nodes"])))
    model = ModelConfig.model_validate(DEMO_MODEL)
    tmp = tempfile.mkdtemp(prefix="hethub-bench-")
    model_json = os.path.join(tmp, "model.json")
    with open(model_json, "w") as f:
        f.write(model.to_json())
    profiles = [profile_model(model, t, mb, "fp32", reps=7, slowdown=k, progress=False)
                for t, k in (("FAST", FAST_SLOWDOWN), ("SLOW", FAST_SLOWDOWN * SLOWDOWN)) for mb in (1, 2, 4, 8)]
    cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5)
    pins = os.path.join(tmp, "demo-profiles")
    os.makedirs(pins)
    for p in profiles:
        with open(os.path.join(pins, f"{p.device_type}-mb{p.micro_batch_size}.json"), "w") as f:
            f.write(p.to_json())
    G = 32
    plan = make_plan(cluster, model, G, opts=PlannerOptions(time_limit_s=20, max_micro_batch_size=8,
                                                            max_tensor_parallel=1), cost_model=cm,
                     with_homogeneous_sum=False)
    # DeepSpeed's own partition: one stage per rank (equal widths over all ranks), its partition_balanced
    from deepspeed.runtime import utils as ds_utils
    weights = [sum(p.numel() for p in l.parameters() if p.requires_grad) for l in build_layers(model)]
    S, b = cluster.num_devices, 2
    bounds = [int(x) for x in ds_utils.partition_balanced(weights=weights, num_parts=S)]
    types = [n.device_type for n in cluster.nodes for _ in range(n.count)]  # hostfile order: FAST x2, SLOW x4
    uniform = build_plan(model, cluster, [StageLayout((bounds[s], bounds[s + 1]), types[s], even_split(b, 1))
                                          for s in range(S)], b, G // b)
    paths = {}
    for name, p in (("plan", plan), ("uniform", uniform)):
        paths[name] = os.path.join(tmp, f"{name}.json")
        with open(paths[name], "w") as f:
            f.write(p.to_json())
    common = ["--model-json", model_json, "--emulate", EMULATE, "--steps", str(steps)]
    pred_plan = predict(plan, cm).iteration_s
    pred_uni = predict(uniform, cm).iteration_s
    rows = []
    for mode, pinned, port in (("pinned", pins, 29701), ("self-calibrated", "", 29704)):
        t_plan = run(plan.world_size, ["--mode", "hethub", "--hetero-plan", paths["plan"], *common],
                     os.path.join(tmp, f"a-{port}.json"), port, pinned)
        t_uni = run(S, ["--mode", "hethub", "--hetero-plan", paths["uniform"], *common],
                    os.path.join(tmp, f"b-{port}.json"), port + 1, pinned)
        t_ds = run(S, ["--mode", "deepspeed", "--stages", str(S), "--micro-batch", str(b), "--micro-batches",
                       str(G // b), "--rank-types", ",".join(types), "--pin-plan", paths["uniform"], *common],
                   os.path.join(tmp, f"c-{port}.json"), port + 2, pinned)
        rows += [
            f"| (a) hethub plan vs DeepSpeed `parameters` partition ({S} x 1), {mode} | {t_plan * 1e3:.1f} ms vs "
            f"{t_ds * 1e3:.1f} ms | {t_ds / t_plan:.2f}x | >= 1.3x |",
            f"| (b) hethub engine vs DeepSpeed engine, same layout, {mode} | {t_uni * 1e3:.1f} ms vs "
            f"{t_ds * 1e3:.1f} ms | {t_uni / t_ds - 1:+.1%} | within 5% |",
            f"| (c) hethub plan: predicted vs measured, {mode} | {pred_plan * 1e3:.1f} ms vs {t_plan * 1e3:.1f} ms | "
            f"{pred_plan / t_plan - 1:+.1%} | within 10% |",
            f"| (c') uniform layout: predicted vs measured, {mode} | {pred_uni * 1e3:.1f} ms vs "
            f"{t_uni * 1e3:.1f} ms | {pred_uni / t_uni - 1:+.1%} | |",
        ]
    layout = "; ".join(f"{stage_types(s)} layers [{s.layers[0]},{s.layers[1]}) (samples "
                       f"{'+'.join(str(r.samples) for r in s.replicas)})" for s in plan.stages)
    text = "\n".join([
        "# Runtime benchmark (emulated 2-type cluster on this 2-core CPU machine, gloo)", "",
        f"Model {model.name} ({model.num_layers} blocks, hidden {model.hidden_size}, seq {model.seq_length}); global "
        f"batch {G}; 2 FAST ranks (this CPU emulated {FAST_SLOWDOWN:g}x slower) + 4 SLOW ranks "
        f"({SLOWDOWN:g}x slower than FAST). Median of {steps - 3} iterations after 3 warm-up, Adam. {measured_note(cluster)}",
        "",
        f"hethub plan: {layout}; micro-batch {plan.micro_batch_size} x {plan.num_micro_batches}.",
        f"DeepSpeed: PipelineModule(partition_method='parameters', num_stages={S}), boundaries {bounds}, micro-batch "
        f"{b} x {G // b}.", "",
        "Pinned: every emulated layer, DeepSpeed's included, takes the time this run's profiles give it; "
        "self-calibrated: k x the fastest real time each rank sees (details under (d)).", "",
        "| comparison | times | result | target |", "|---|---|---|---|", *rows, *fidelity(steps, tmp), ""])
    write_result("runtime.md", text)


if __name__ == "__main__":
    main()
