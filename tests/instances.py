"""Clusters and random planning instances several pure-tier test files share (torch-free)."""
import json
import random

from hethub.partitioner import Cluster, ModelConfig, Plan
from hethub.partitioner.placement import StageLayout, build_plan

MIXED = Cluster.model_validate({
    "name": "mixed",
    "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 4}, {"host": "v", "device_type": "V100-32GB", "count": 4},
              {"host": "m", "device_type": "MI250X", "count": 2}],
    "network": {"intra_node_gbps": 2400, "inter_node_gbps": 100}})


TWO_TYPE = Cluster.model_validate({
    "name": "a100-v100", "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 8},
                                   {"host": "v", "device_type": "V100-32GB", "count": 8}],
    "network": {"intra_node_gbps": 2400, "inter_node_gbps": 200}})


# The elastic tests' model and cluster: priced as a model large enough that the planner uses every device (the
# ranks train the small layer stack), on two hosts of two FAST and two SLOW devices.
ELASTIC_PRICED = ModelConfig(name="stack-priced", architecture="gpt", num_layers=5, hidden_size=2048,
                             num_attention_heads=16, ffn_hidden_size=8192, vocab_size=512, seq_length=512)


def two_host_cluster(fast: str, slow: str, memory_gib: float = 64) -> Cluster:
    return Cluster.model_validate({
        "name": "fast-slow",
        "device_types": {k: {"vendor": "cpu", "peak_tflops": {"fp32": tf}, "memory_gib": memory_gib, "memory_gbps": 20}
                         for k, tf in (("FAST", 2), ("SLOW", 1))},
        "nodes": [{"host": fast, "device_type": "FAST", "count": 2}, {"host": slow, "device_type": "SLOW", "count": 2}],
        "network": {"intra_node_gbps": 800, "inter_node_gbps": 100}})


def write_elastic_plan(cluster: Cluster, path) -> str:
    """The planner's plan of ELASTIC_PRICED on ``cluster`` (global batch 8, every device used), written to ``path``.
    Solved to optimality (0.1 s idle): with a 2-s limit, one suite run's load cut the search short of the plan that
    uses every device."""
    from hethub.partitioner.api import make_plan
    from hethub.partitioner.costmodel import CostModel
    from hethub.partitioner.planner import PlannerOptions
    plan = make_plan(cluster, ELASTIC_PRICED, 8, opts=PlannerOptions(time_limit_s=120, max_tensor_parallel=1),
                     with_homogeneous_sum=False, cost_model=CostModel(cluster, ELASTIC_PRICED, dtype="fp32"))
    assert plan.solver.status == "optimal" and plan.world_size == 4, (plan.solver, plan.world_size)
    with open(path, "w") as f:
        f.write(plan.to_json())
    return str(path)


def random_instance(seed: int, vendors=("nvidia", "amd"), min_types: int = 1):
    rng = random.Random(seed)
    n_types = rng.randint(min_types, 3)
    types = {f"T{k}": {"vendor": rng.choice(vendors), "peak_tflops": rng.choice([20, 60, 150, 300]),
                       "memory_gib": rng.choice([3, 4, 6, 16]), "memory_gbps": rng.choice([300, 900, 2000]),
                       "efficiency": rng.choice([0.3, 0.5])} for k in range(n_types)}
    total = rng.randint(n_types, 8)
    counts = [1] * n_types
    for _ in range(total - n_types):
        counts[rng.randrange(n_types)] += 1
    nodes = []
    for k, cnt in enumerate(counts):
        split = rng.randint(1, cnt) if cnt > 1 and rng.random() < 0.4 else cnt  # sometimes two nodes of a type
        nodes.append({"host": f"h{k}a", "device_type": f"T{k}", "count": split})
        if cnt - split:
            nodes.append({"host": f"h{k}b", "device_type": f"T{k}", "count": cnt - split})
    cluster = Cluster.model_validate({"name": f"rand{seed}", "device_types": types, "nodes": nodes,
                                      "network": {"intra_node_gbps": rng.choice([800, 2400]),
                                                  "inter_node_gbps": rng.choice([25, 100, 400])}})
    model = ModelConfig(name=f"m{seed}", architecture=rng.choice(["gpt", "llama"]), num_layers=rng.randint(1, 10),
                        hidden_size=rng.choice([1024, 2048]), num_attention_heads=16,
                        ffn_hidden_size=rng.choice([2816, 4096, 8192]), vocab_size=32000,
                        seq_length=rng.choice([1024, 2048]))
    batch = rng.choice([4, 6, 8, 12, 16])
    return cluster, model, batch


CPU_CLUSTER = Cluster.model_validate({
    "name": "cpu-box",
    "device_types": {"CPU": {"vendor": "cpu", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20}},
    "nodes": [{"host": "localhost", "device_type": "CPU", "count": 8}]})
STACK = ModelConfig(name="stack", architecture="gpt", num_layers=5, hidden_size=12, num_attention_heads=1,
                    ffn_hidden_size=12, vocab_size=6, seq_length=1)  # 7 planner layers


def stack_plan(cuts, splits, micro_batch, micro_batches, boundaries=()):
    bounds = [0, *cuts, STACK.num_planner_layers]
    layouts = [StageLayout((bounds[i], bounds[i + 1]), "CPU", tuple(s)) for i, s in enumerate(splits)]
    plan = build_plan(STACK, CPU_CLUSTER, layouts, micro_batch, micro_batches)
    if boundaries:
        from hethub.partitioner import Plan
        plan = Plan.model_validate({**plan.model_dump(), "boundaries": list(boundaries)})
    return plan


CASES = {
    "1to1": ([3], [[4], [4]], 4, 3),
    "1to2": ([4], [[4], [2, 2]], 4, 3),
    "2to1": ([2], [[2, 2], [4]], 4, 3),
    "2to3": ([3], [[3, 3], [2, 2, 2]], 6, 3),
    "3to2": ([3], [[2, 2, 2], [3, 3]], 6, 2),
    "1to2to1": ([2, 5], [[4], [2, 2], [4]], 4, 3),  # both a 1 -> 2 and a 2 -> 1 boundary
    "uneven2to3": ([4], [[4, 2], [1, 2, 3]], 6, 3),
    # the cross-vendor bridge (host buffers over a separate gloo group), lossless wire
    "bridge2to3": ([3], [[3, 3], [2, 2, 2]], 6, 3, [{"after_stage": 0, "transport": "host"}]),
}


TWO_VENDORS = Cluster.model_validate({
    "name": "two-vendors",
    "device_types": {"NV": {"vendor": "nvidia", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20},
                     "AM": {"vendor": "amd", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20}},
    "nodes": [{"host": "nv", "device_type": "NV", "count": 4}, {"host": "am", "device_type": "AM", "count": 4}]})
VENDOR_MODEL = ModelConfig(name="m", architecture="gpt", num_layers=5, hidden_size=16, num_attention_heads=2,
                    ffn_hidden_size=32, vocab_size=8, seq_length=1)


def mixed_vendor_plan() -> Plan:
    """Stage 0 on NVIDIA (width 2), stage 1 spanning vendors (one NV and one AM replica), stage 2 on AMD; both
    boundaries go through the host."""
    base = build_plan(VENDOR_MODEL, TWO_VENDORS, [StageLayout((0, 2), "NV", (2, 2)), StageLayout((2, 4), "NV", (3, 1)),
                                   StageLayout((4, 7), "AM", (2, 2))], 4, 3)
    data = json.loads(base.to_json())
    data["stages"][1]["replicas"][1].update({"host": "am", "slot": 2, "device_type": "AM"})
    data["boundaries"] = [{"after_stage": 0, "transport": "host"}, {"after_stage": 1, "transport": "host"}]
    return Plan.model_validate(data)
