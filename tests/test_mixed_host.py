"""A host with several device types (a workstation with an RTX 4090 and an RTX 3090): listed once per type, its
slots numbered across its entries in file order; planned, shown, dry-run and launched ``--local``."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_cli
from dist_util import one_process
from hethub.partitioner import Cluster, ModelConfig, Plan
from hethub.partitioner.placement import StageLayout, build_plan

BOX = {"name": "workstation", "nodes": [{"host": "box", "device_type": "RTX-4090", "count": 1},
                                        {"host": "box", "device_type": "RTX-3090", "count": 2},
                                        {"host": "other", "device_type": "RTX-3090", "count": 1}],
       "network": {"intra_node_gbps": 200, "inter_node_gbps": 25}}
MODEL = ModelConfig(name="m", architecture="gpt", num_layers=4, hidden_size=64, num_attention_heads=4,
                    ffn_hidden_size=256, vocab_size=128, seq_length=32)


def test_a_host_listed_once_per_type_numbers_its_slots_in_file_order():
    cluster = Cluster.model_validate(BOX)
    assert cluster.hosts == ["box", "other"] and cluster.host_count("box") == 3
    assert [cluster.slot_type("box", s) for s in range(4)] == ["RTX-4090", "RTX-3090", "RTX-3090", None]
    plan = build_plan(MODEL, cluster, [StageLayout((0, 3), "RTX-4090", (4,)),
                                       StageLayout((3, 6), "RTX-3090", (2, 2))], 4, 4)
    placed = {(r.host, r.slot): st.type_of(r) for st in plan.stages for r in st.replicas}
    assert placed == {("box", 0): "RTX-4090", ("box", 1): "RTX-3090", ("box", 2): "RTX-3090"}  # one host first
    from hethub.cli.launch import hostfile_text, include_arg
    from hethub.runtime.checks import plan_local_index
    assert hostfile_text(plan) == "box slots=3\n" and include_arg(plan) == "box:0,1,2"
    assert [plan_local_index(plan, r) for r in range(3)] == [0, 1, 2]


def test_the_same_type_twice_on_a_host_and_a_replica_on_another_types_slot_are_one_line():
    twice = {**BOX, "nodes": BOX["nodes"] + [{"host": "box", "device_type": "RTX-4090", "count": 1}]}
    with pytest.raises(ValueError, match=r"nodes\[3\].host: duplicate host 'box' with device_type 'RTX-4090'"):
        Cluster.model_validate(twice)
    data = build_plan(MODEL, Cluster.model_validate(BOX), [StageLayout((0, 6), "RTX-3090", (4,))], 4, 4).model_dump()
    data["stages"][0]["replicas"][0].update(host="box", slot=0)  # box:0 is the RTX-4090
    with pytest.raises(ValueError, match=r"replicas\[0\].host: 'box' holds RTX-4090 at slot 0, but the replica runs "
                                         r"on RTX-3090"):
        Plan.model_validate(data)


def test_plan_show_and_a_dry_run_of_a_mixed_workstation(tmp_path):
    cluster = tmp_path / "box.json"
    cluster.write_text(json.dumps({**BOX, "nodes": BOX["nodes"][:2]}))
    plan = tmp_path / "plan.json"
    r = run_cli("plan", "--cluster", str(cluster), "--model", "gpt-125m", "--global-batch", "8", "--time-limit", "5",
                "-o", str(plan))
    assert r.returncode == 0, r.stderr
    p = Plan.model_validate_json(plan.read_text())
    assert {st.type_of(r) for st in p.stages for r in st.replicas} == {"RTX-4090", "RTX-3090"}
    assert {r.host for st in p.stages for r in st.replicas} == {"box"}
    shown = run_cli("show", str(plan))
    assert shown.returncode == 0, shown.stderr
    shown_slots = {int(k) for cell in re.findall(r"box:([\d,]+)", shown.stdout) for k in cell.split(",")}
    assert shown_slots == {r.slot for st in p.stages for r in st.replicas} == {0, 1, 2}, shown.stdout
    dry = run_cli("launch", "--hetero-plan", str(plan), "--dry-run", os.path.join("examples", "train_gpt.py"))
    assert dry.returncode == 0, dry.stderr
    assert "box slots=3\n" in dry.stdout and "--include box:" in dry.stdout  # all the host's devices, both types


SCRIPT = os.path.join(ROOT, "tests", "workers", "ds_pipeline_script.py")
DS_MODEL = ModelConfig(name="ds-script", architecture="gpt", num_layers=9, hidden_size=8, num_attention_heads=1,
                       ffn_hidden_size=8, vocab_size=8, seq_length=1)  # the script's 11 layer specs
CPU_TYPES = {"vendor": "cpu", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20}
LOCALHOST = {"name": "one-box", "device_types": {"CPU-FAST": CPU_TYPES, "CPU-SLOW": CPU_TYPES},
             "nodes": [{"host": "localhost", "device_type": "CPU-FAST", "count": 1},
                       {"host": "localhost", "device_type": "CPU-SLOW", "count": 2}]}


@pytest.mark.dist
def test_a_mixed_host_plan_runs_local_each_rank_on_its_type_and_trains_like_one_process(tmp_path):
    pytest.importorskip("deepspeed")
    plan = build_plan(DS_MODEL, Cluster.model_validate(LOCALHOST),
                      [StageLayout((0, 5), "CPU-FAST", (6,)), StageLayout((5, 11), "CPU-SLOW", (2, 4))], 6, 4)
    (tmp_path / "plan.json").write_text(plan.to_json())
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 6,
                               "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HETHUB_EMULATE_SLOWDOWN="CPU-SLOW=1.5",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = ["--steps", "2", "--deepspeed_config", str(cfg)]
    ref = one_process([SCRIPT, "--out", str(tmp_path / "ref"), "--stages", "1", *common],
                      extra_env={"HETHUB_EMULATE_SLOWDOWN": env["HETHUB_EMULATE_SLOWDOWN"]})
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", str(tmp_path / "plan.json"),
                          "--local", SCRIPT, "--out", str(tmp_path / "run"), *common], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = torch.load(str(tmp_path / "ref.0"), weights_only=True)["losses"]
    got = [torch.load(str(tmp_path / f"run.{r}"), weights_only=True) for r in range(3)]
    assert [(g["device_type"], g["local_rank"]) for g in got] == [("CPU-FAST", "0"), ("CPU-SLOW", "1"),
                                                                  ("CPU-SLOW", "2")]
    for g in got:
        torch.testing.assert_close(g["losses"], want, rtol=2e-5, atol=0)


def test_traffic_between_two_types_of_one_host_is_priced_at_the_slower_ends_intra_figure():
    from hethub.partitioner.costmodel import CostModel
    data = {**BOX, "network": {"intra_node_gbps": {"RTX-4090": 400, "RTX-3090": 100}}}
    cm = CostModel(Cluster.model_validate(data), MODEL)
    one_gb = 1e9 / 8
    for a, b in (("RTX-4090", "RTX-3090"), ("RTX-3090", "RTX-4090")):
        assert cm.p2p_s(one_gb * 100, a, b, same_host=True) == pytest.approx(1.0, rel=1e-3)
    assert cm.p2p_s(one_gb * 400, "RTX-4090", "RTX-4090", same_host=True) == pytest.approx(1.0, rel=1e-3)
