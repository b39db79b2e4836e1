"""Clusters and random planning instances several pure-tier test files share (torch-free)."""
import random

from hethub.partitioner import Cluster, ModelConfig

MIXED = Cluster.model_validate({
    "name": "mixed",
    "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 4}, {"host": "v", "device_type": "V100-32GB", "count": 4},
              {"host": "m", "device_type": "MI250X", "count": 2}],
    "network": {"intra_node_gbps": 2400, "inter_node_gbps": 100}})


TWO_TYPE = Cluster.model_validate({
    "name": "a100-v100", "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 8},
                                   {"host": "v", "device_type": "V100-32GB", "count": 8}],
    "network": {"intra_node_gbps": 2400, "inter_node_gbps": 200}})


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
