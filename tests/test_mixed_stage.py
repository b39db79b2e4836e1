"""Mixed-type stages: a replica may name its own device type (one stage over, e.g., 4 A100 + 4 V100).
Validated per replica, priced by its slowest replica, replayed per replica, and trained exactly."""
import json

import pytest
import torch

from hethub.partitioner import Cluster, InputError, Plan
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.evaluate import stage_costs
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.records import ModelConfig
from hethub.partitioner.simulator import simulate

CLUSTER = Cluster.model_validate({
    "name": "mixed", "device_types": {"FAST": {"vendor": "cpu", "peak_tflops": {"fp32": 3}, "memory_gib": 16,
                                               "memory_gbps": 20},
                                      "SLOWER": {"vendor": "cpu", "peak_tflops": {"fp32": 1}, "memory_gib": 16,
                                                 "memory_gbps": 20}},
    "nodes": [{"host": "fast", "device_type": "FAST", "count": 4}, {"host": "slow", "device_type": "SLOWER",
                                                                    "count": 4}]})
MODEL = ModelConfig(name="stack", architecture="gpt", num_layers=5, hidden_size=12, num_attention_heads=1,
                    ffn_hidden_size=12, vocab_size=6, seq_length=1)


def mixed_plan(split=(4, 2)) -> Plan:
    """Stage 0: one FAST replica; stage 1: a FAST replica and a SLOWER one (the given split)."""
    base = build_plan(MODEL, CLUSTER, [StageLayout((0, 3), "FAST", (6,)), StageLayout((3, 7), "FAST", split)], 6, 3)
    data = json.loads(base.to_json())
    data["stages"][1]["replicas"][1].update({"host": "slow", "slot": 0, "device_type": "SLOWER"})
    return Plan.model_validate(data)


def test_a_replica_names_its_type_round_trips_and_is_validated():
    plan = mixed_plan()
    assert Plan.model_validate_json(plan.to_json()) == plan
    assert plan.stages[1].types == ["FAST", "SLOWER"]
    data = json.loads(plan.to_json())
    data["stages"][1]["replicas"][1]["host"] = "fast"  # the FAST host holds no SLOWER device
    data["stages"][1]["replicas"][1]["slot"] = 3
    with pytest.raises(InputError, match=r"stages\[1\]\.replicas\[1\]\.host: 'fast' holds FAST, but the replica "
                                         r"runs on SLOWER"):
        Plan.from_json(json.dumps(data))
    data["stages"][1]["replicas"][1]["device_type"] = "TPU"
    with pytest.raises(InputError, match=r"stages\[1\]\.replicas\[1\]\.device_type: cluster 'mixed' has no 'TPU'"):
        Plan.from_json(json.dumps(data))


def test_the_slowest_replica_paces_the_stage_in_cost_and_replay():
    cm = CostModel(CLUSTER, MODEL, dtype="fp32")
    even, proportional = mixed_plan((3, 3)), mixed_plan((4, 2))
    f_fast = sum(cm.stage_compute_s("FAST", 3, 7, 3))
    f_slow = sum(cm.stage_compute_s("SLOWER", 3, 7, 3))
    assert stage_costs(even, cm)[1].compute_s == pytest.approx(max(f_fast, f_slow)) == pytest.approx(f_slow)
    # a speed-proportional split moves samples to the FAST replica and shortens the stage
    assert stage_costs(proportional, cm)[1].compute_s < stage_costs(even, cm)[1].compute_s
    res = simulate(proportional, cm)
    b_slow = [e for e in res.events if e.rank == 2 and e.kind == "B"][0]
    assert b_slow.end_s - b_slow.start_s == pytest.approx(cm.stage_compute_s("SLOWER", 3, 7, 2)[1])


@pytest.mark.dist
def test_a_mixed_stage_trains_like_one_process(tmp_path):
    from plans import run_and_compare
    plan = mixed_plan((4, 2))
    got, _ = run_and_compare(tmp_path, plan, rtol=1e-5, atol=1e-5)
    types = [torch.load(str(tmp_path / f"rank{r}.pt"), weights_only=True)["device_type"] for r in range(3)]
    assert types == ["FAST", "FAST", "SLOWER"]  # each rank knows its own type (emulation, device checks)


@pytest.mark.dist
def test_a_stage_spanning_vendors_all_reduces_through_the_host_bridge(tmp_path):
    """One replica of each vendor in stage 1 (uneven split), ZeRO-1 and clipping: the gradient all-reduce and
    ZeRO-1's all-gather run on the stage's gloo group over host buffers, and training matches one process."""
    from plans import run_and_compare
    two = Cluster.model_validate({
        "name": "two-vendors",
        "device_types": {"NV": {"vendor": "nvidia", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20},
                         "AM": {"vendor": "amd", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20}},
        "nodes": [{"host": "nv", "device_type": "NV", "count": 3}, {"host": "am", "device_type": "AM", "count": 2}]})
    base = build_plan(MODEL, two, [StageLayout((0, 3), "NV", (6,)), StageLayout((3, 7), "NV", (4, 2))], 6, 3)
    data = json.loads(base.to_json())
    data["stages"][1]["replicas"][1].update({"host": "am", "slot": 0, "device_type": "AM"})
    plan = Plan.model_validate(data)
    cm = CostModel(two, MODEL, dtype="fp32")
    assert cm.sync_s(cm.stage_params(3, 7), plan.stages[1].types, 2, False) > cm.sync_s(
        cm.stage_params(3, 7), ["NV"], 2, False)  # priced as the bridge
    run_and_compare(tmp_path, plan, rtol=1e-5, atol=1e-5, extra=["zero1"])
    bridged = [torch.load(str(tmp_path / f"rank{r}.pt"), weights_only=True)["stage_bridge"] for r in range(3)]
    assert bridged == [False, True, True]  # only stage 1 spans vendors
    # every group the ranks created, with its backend choice: none but gloo spans vendors, and the world is gloo
    vendor = {0: "nvidia", 1: "nvidia", 2: "amd"}
    for r in range(3):
        got = torch.load(str(tmp_path / f"rank{r}.pt"), weights_only=True)
        assert got["world_backend"] == "gloo"
        assert got["groups"] and all(backend == "gloo" for _purpose, ranks, backend in got["groups"]
                                     if len({vendor[k] for k in ranks}) > 1), got["groups"]
