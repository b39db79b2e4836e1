"""The planner against its peers' plan shapes, on clusters shaped like Sailor's own cases.

Two clusters of 4-GPU hosts (32 A100-40GB + 96 V100-16GB; 80 A100-40GB + 240 V100-16GB), an OPT-350M-shaped model
(24 blocks, hidden 1024, sequence 2048), global batch 1024, Sailor's link figures (intra-node 14 Gbit/s on A100
hosts, 10 on V100 hosts, 12 Gbit/s between hosts). Per-layer times are the analytic cost model's unless
``--profiles DIR`` gives measured ones. Every plan is scored the same way:

- closed form: the objective the MILP ranks by (``evaluate.closed_form_s``);
- replay: ``hethub simulate``'s event-level replay of the written plan (what ``plan`` predicts);
- no overlap: the network model of Sailor's simulator (boundary transfers add to compute, the whole all-reduce
  after the last backward; ``evaluate.no_overlap_s``).

Each case is priced twice: by the analytic cost model, and by profiles standing in for measured ones (the same
times, each layer's forward and backward off by up to ``--noise``, 3% by default, seeded: measured blocks are
never identical, which took the search off its shape MILP before blocks within noise were priced alike).

Plans scored: hethub's (``--schedule auto`` and ``1f1b``), a Metis-shaped plan per case (three stages on
32 V100 | 64 V100 | 32 A100 devices, or the same proportions at the larger case: per micro-batch size the layer
cuts the closed form ranks best, and of those the one that replays fastest), and every plan file given with ``--plan`` (e.g. a peer's
plan written as a hethub plan).

Cases 3 and 4 are hethub's own at that scale (128 devices on 8-GPU hosts and 100 Gbit/s; 320 on 4-GPU hosts and
25 Gbit/s): ``--cases 3,4 --out peers-own.md``.

Sailor's own measured profiles of these two types (a checkout of github.com/eth-easl/sailor), read by
``benchmarks/sailor_profiles.py``: ``--profiles DIR --out peers-sailor.md``.

Run: python benchmarks/peers.py [--time-limit 60] [--cases 1,2] [--profiles DIR] [--plan FILE ...] [--out NAME]
Writes benchmarks/results/peers.md (or NAME).
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_io import write_result  # noqa: E402

from hethub.partitioner import Cluster, ModelConfig  # noqa: E402
from hethub.partitioner.api import make_plan  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.errors import InfeasibleError  # noqa: E402
from hethub.partitioner.evaluate import closed_form_s, fits_memory, no_overlap_s, predict  # noqa: E402
from hethub.partitioner.records import load_profiles  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan, even_split  # noqa: E402
from hethub.partitioner.planner import PlannerOptions  # noqa: E402
from hethub.partitioner.records import Plan, Profile  # noqa: E402
from hethub.partitioner.simulator import simulate  # noqa: E402

GLOBAL_BATCH = 1024
OPT_350M = ModelConfig.model_validate({
    "name": "opt-350m", "architecture": "gpt", "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
    "ffn_hidden_size": 4096, "vocab_size": 50272, "seq_length": 2048})
NETWORK = {"intra_node_gbps": {"A100-40GB": 14, "V100-16GB": 10}, "inter_node_gbps": 12}


def cluster(a100_hosts: int, v100_hosts: int, per_host: int = 4, network: dict = NETWORK) -> Cluster:
    nodes = ([{"host": f"a{i}", "device_type": "A100-40GB", "count": per_host} for i in range(a100_hosts)]
             + [{"host": f"v{i}", "device_type": "V100-16GB", "count": per_host} for i in range(v100_hosts)])
    return Cluster.model_validate({"name": f"sailor-{per_host * (a100_hosts + v100_hosts)}", "nodes": nodes,
                                   "network": network})


# Sailor's two cases, then two of hethub's own at that scale (8-GPU hosts on 100 Gbit/s; 4-GPU hosts on 25)
CASES = {"1": ("32 A100-40 + 96 V100-16", cluster(8, 24)), "2": ("80 A100-40 + 240 V100-16", cluster(20, 60)),
         "3": ("64 A100-40 + 64 V100-16, 8-GPU hosts, 100 Gbit/s",
               cluster(8, 8, 8, {"intra_node_gbps": 2400, "inter_node_gbps": 100})),
         "4": ("160 A100-40 + 160 V100-16, 25 Gbit/s",
               cluster(40, 40, 4, {"intra_node_gbps": {"A100-40GB": 14, "V100-16GB": 10}, "inter_node_gbps": 25}))}


def metis_shaped(cm: CostModel) -> Plan:
    """Three stages on a quarter, a half and a quarter of the devices (V100 | V100 | A100: Metis's case-1 plan,
    32 | 64 | 32): per micro-batch size the layer cuts the closed form ranks best, checked to fit memory, and of
    those the one that replays fastest (as hethub chooses among its own best chains: the closed form prices a
    single wave of wide reshards far too low, and picked one micro-batch of 1024 on case 4 that replays 41% under
    it)."""
    counts = cm.cluster.count_by_type()
    v, a = counts["V100-16GB"], counts["A100-40GB"]
    widths, types = (v // 3, v - v // 3, a), ("V100-16GB", "V100-16GB", "A100-40GB")
    L = cm.model.num_planner_layers
    per_size = []
    for b in (b for b in (64, 128, 256, 512, 1024) if b >= max(widths) and GLOBAL_BATCH % b == 0):
        best = None
        for c1, c2 in itertools.combinations(range(1, L), 2):
            bounds = (0, c1, c2, L)
            layouts = [StageLayout((bounds[s], bounds[s + 1]), types[s], even_split(b, widths[s])) for s in range(3)]
            plan = build_plan(cm.model, cm.cluster, layouts, b, GLOBAL_BATCH // b, dtype=cm.dtype)
            t = closed_form_s(plan, cm)
            if (best is None or t < best[0]) and fits_memory(plan, cm):
                best = (t, plan)
        if best is not None:
            per_size.append(best[1])
    if not per_size:
        raise InfeasibleError("metis", "no Metis-shaped plan fits memory")
    return min(per_size, key=lambda plan: simulate(plan, cm).iteration_s)


def noisy_profiles(cm: CostModel, noise: float, seed: int = 1) -> list[Profile]:
    """Profiles of every device type at micro-batch 1: the cost model's layer times, each off by up to ``noise``."""
    rng = random.Random(seed)
    kinds = [li.kind for li in cm.model.layers()]
    out = []
    for t in cm.cluster.type_names:
        fwd, bwd, _, _ = cm.layer_times(t)
        layers = [{"index": i, "kind": kinds[i], "forward_ms": f * 1e3 * (1 + rng.uniform(-noise, noise)),
                   "backward_ms": b * 1e3 * (1 + rng.uniform(-noise, noise))} for i, (f, b) in enumerate(zip(fwd, bwd))]
        out.append(Profile.model_validate({"device_type": t, "model": cm.model.model_dump(), "micro_batch_size": 1,
                                           "dtype": cm.dtype, "layers": layers}))
    return out


def shape(plan: Plan) -> str:
    parts = []
    for st in plan.stages:
        types = sorted({st.type_of(r) for r in st.replicas})
        parts.append(f"{st.width}x{'+'.join(t.split('-')[0] for t in types)}"
                     + (f" tp{st.tensor_parallel}" if st.tensor_parallel > 1 else ""))
    return " \\| ".join(parts) if len(parts) <= 4 else f"{len(parts)} stages: " + ", ".join(parts[:3]) + ", ..."


def score(name: str, plan: Plan, cm: CostModel, plan_s: float | None) -> str:
    replay = simulate(plan, cm).iteration_s
    closed = closed_form_s(plan, cm) + cm.control_syncs_s(plan)  # the replay adds them too
    B = plan.global_batch_size
    return (f"| {name} | {plan.schedule} | {shape(plan)} | {plan.micro_batch_size} x {plan.num_micro_batches} | "
            f"{B / closed:,.1f} | {B / replay:,.1f} | {closed / replay:.3f} | {B / no_overlap_s(plan, cm):,.1f} | "
            f"{'yes' if fits_memory(plan, cm) else 'no'} | {f'{plan_s:.1f}' if plan_s is not None else '-'} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--cases", default="1,2")
    ap.add_argument("--profiles", help="a folder of `hethub profile` files for A100-40GB and V100-16GB")
    ap.add_argument("--plan", action="append", default=[], help="a plan file to score (its cluster and model)")
    ap.add_argument("--noise", type=float, default=0.03, help="the measured-like profiles' noise (0: analytic only)")
    ap.add_argument("--out", default="peers.md", help="the results file's name under benchmarks/results")
    args = ap.parse_args(argv)
    profiles = load_profiles(args.profiles) if args.profiles else ()
    rows = []
    pricings = [("analytic" if not profiles else "profiles", profiles)]
    if args.noise and not profiles:
        pricings.append((f"noisy {args.noise:.0%}", noisy_profiles(CostModel(CASES["1"][1], OPT_350M, dtype="fp16"),
                                                                   args.noise)))
    for key, (pricing, profs) in itertools.product(args.cases.split(","), pricings):
        title, cl = CASES[key]
        title = f"{title} ({pricing})"
        cm = CostModel(cl, OPT_350M, profiles=profs, dtype="fp16")
        for schedule, network in (("auto", "overlap"), ("1f1b", "overlap"), ("auto", "no-overlap")):
            t0 = time.perf_counter()
            plan = make_plan(cl, OPT_350M, GLOBAL_BATCH, opts=PlannerOptions(time_limit_s=args.time_limit,
                                                                             schedule=schedule, network=network),
                             cost_model=cm, with_homogeneous_sum=False)
            took = time.perf_counter() - t0
            flags = f"--schedule {schedule}" + (f" --network {network}" if network != "overlap" else "")
            rows.append(score(f"{title}: hethub {flags} (gap {plan.solver.gap:.1%})", plan, cm, took))
            print(rows[-1], flush=True)
        rows.append(score(f"{title}: Metis-shaped", metis_shaped(cm), cm, None))
        print(rows[-1], flush=True)
    for path in args.plan:
        plan = Plan.model_validate_json(open(path).read())
        cm = CostModel(plan.cluster, plan.model, profiles=profiles, dtype=plan.dtype or "fp16")
        rows.append(score(os.path.basename(path), plan.model_copy(update={"predicted": predict(plan, cm)}), cm, None))
    load = os.getloadavg()[0]
    write_result(args.out, "\n".join([
        f"# The planner against its peers' plan shapes (2 cores, load {load:.1f}; time limit {args.time_limit:g} s; "
        f"per-layer times: {'profiles ' + args.profiles if args.profiles else 'analytic, and noisy profiles'})", "",
        "OPT-350M-shaped model, global batch 1024, fp16. Cases 1 and 2: 4-GPU hosts, Sailor's link figures "
        "(intra-node 14 Gbit/s on A100 hosts, 10 on V100 hosts; 12 Gbit/s between hosts); cases 3 and 4 as named. "
        "gap: the search's proven gap on its closed form. closed form: what the MILP ranks by; replay: "
        "`hethub simulate` of the plan (what `plan` predicts); closed / replay: iteration times (target 0.95-1.05); "
        "no overlap: samples/s as Sailor's simulator's network model prices the plan. A Metis-shaped plan: "
        "Metis's case-1 stage shape (V100 | V100 | A100 on a quarter, a half and a quarter of the devices), its "
        "layer cuts the best this cost model finds at each micro-batch size, the fastest replay of those.", "",
        "| plan | schedule | stages (replicas) | micro-batch | closed form samples/s | replay samples/s "
        "| closed / replay | no overlap samples/s | fits memory | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]))


if __name__ == "__main__":
    main()
