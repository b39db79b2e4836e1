"""Tier 2 (multi-process gloo): an elastic start re-plans for the ranks present and resumes from the newest checkpoint.

Two hosts of the plan's cluster, "fast" and "slow", two devices each. The job trains on both and the engine saves
every 2 steps by itself; it stops between two saves (the work since the last save is what a lost host costs). The
ranks of "fast" alone start next: they agree on who is there, rank 0 re-plans for two FAST devices, and the job
resumes from the newest complete checkpoint; then both hosts again, under the plan for both. Every step's loss
equals one process training the same global batches (float64), each plan the job ran under is in
DIR/plans/step-<k>.json, and each start says in one line which hosts are missing.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from dist_util import spawn
from hethub.partitioner import Cluster, ModelConfig, load_plan
from hethub.partitioner.api import make_plan
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.planner import PlannerOptions

pytestmark = pytest.mark.dist

pytest.importorskip("deepspeed")

WORKER = os.path.join("tests", "workers", "elastic.py")
# Priced as a model large enough that the planner uses every device (the ranks train the 7-layer stack).
PRICED = ModelConfig(name="stack-priced", architecture="gpt", num_layers=5, hidden_size=2048, num_attention_heads=16,
                     ffn_hidden_size=8192, vocab_size=512, seq_length=512)
TWO_HOSTS = Cluster.model_validate({
    "name": "fast-slow",
    "device_types": {"FAST": {"vendor": "cpu", "peak_tflops": {"fp32": 2}, "memory_gib": 64, "memory_gbps": 20},
                     "SLOW": {"vendor": "cpu", "peak_tflops": {"fp32": 1}, "memory_gib": 64, "memory_gbps": 20}},
    "nodes": [{"host": "fast", "device_type": "FAST", "count": 2}, {"host": "slow", "device_type": "SLOW", "count": 2}],
    "network": {"intra_node_gbps": 800, "inter_node_gbps": 100}})
BOTH, FAST_ONLY = "fast,fast,slow,slow", "fast,fast"


def _base_plan(tmp_path) -> str:
    plan = make_plan(TWO_HOSTS, PRICED, 8, opts=PlannerOptions(time_limit_s=2, max_tensor_parallel=1),
                     with_homogeneous_sum=False, cost_model=CostModel(TWO_HOSTS, PRICED, dtype="fp32"))
    assert plan.world_size == 4
    path = str(tmp_path / "plan.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    return path


def _phase(tmp_path, plan, name, hosts, last):
    ckpt = str(tmp_path / "ckpt")
    out = str(tmp_path / f"{name}-{{rank}}.json")
    results = spawn(len(hosts.split(",")), [WORKER, plan, out, ckpt, "2", str(last), hosts], timeout=120)
    for rank, (rc, _o, err) in enumerate(results):
        assert rc == 0, f"{name} rank {rank}:\n{err[-3000:]}"
    said = [line for line in results[0][2].splitlines() if line.startswith("hethub elastic:")]
    got = [json.load(open(out.replace("{rank}", str(r)))) for r in range(len(results))]
    return got, said


def test_an_elastic_job_replans_for_the_host_left_and_grows_back_losing_nothing(tmp_path, capsys):
    plan = _base_plan(tmp_path)
    ref = str(tmp_path / "ref.json")
    r = subprocess.run([sys.executable, WORKER, "single", ref, "9"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    expect = {int(k): v for k, v in json.load(open(ref))["losses"].items()}

    first, said1 = _phase(tmp_path, plan, "both", BOTH, 5)  # saves at 2 and 4; step 5's work is not saved
    alone, said2 = _phase(tmp_path, plan, "alone", FAST_ONLY, 7)  # "slow" is gone: resumes at 4, saves at 6
    again, said3 = _phase(tmp_path, plan, "again", BOTH, 9)  # "slow" is back: resumes at 6
    assert [g["first"] for g in (first[0], alone[0], again[0])] == [0, 4, 6]
    assert [g["plan_world"] for g in (first[0], alone[0], again[0])] == [4, 2, 4]
    assert alone[0]["hosts"] == ["fast"] and again[0]["hosts"] == ["fast", "slow"]
    for got in (first, alone, again):
        for g in got:  # every rank returns every step's global loss: that of one process on the same batches
            for step, loss in g["losses"].items():
                assert loss == pytest.approx(expect[int(step)], rel=1e-10), (step, g)
    assert "every host present" in said1[0] and "hosts missing: slow" in said2[0] and "every host present" in said3[0]
    assert len(said1) == 1 and "first step under this plan (step 5)" in said2[1] and "after the last step before the " \
        "restart (step 5)" in said2[1]  # the job stood still from its step 5 (unsaved) to its step 5 redone
    plans = tmp_path / "ckpt" / "plans"
    assert sorted(os.listdir(plans)) == [".heartbeat", "step-0.json", "step-4.json", "step-6.json"]
    assert {r.host for st in load_plan(str(plans / "step-4.json")).stages for r in st.replicas} == {"fast"}
    assert load_plan(str(plans / "step-6.json")).world_size == 4
    from hethub.cli.main import main
    assert main(["show", str(tmp_path / "ckpt")]) == 0  # the plans the run ran under, one row each
    shown = capsys.readouterr().out
    rows = [line for line in shown.splitlines() if line.strip().startswith(("│ 0 ", "│ 4 ", "│ 6 "))]
    assert len(rows) == 3 and "slow" not in rows[1] and "slow" in rows[2], shown


def test_workers_on_a_host_the_plan_does_not_name_end_with_one_line_before_any_collective(tmp_path):
    plan = _base_plan(tmp_path)
    results = spawn(2, [WORKER, plan, str(tmp_path / "x{rank}.json"), str(tmp_path / "ckpt"), "2", "1",
                        "elsewhere,elsewhere"], timeout=60)
    for rc, _o, err in results:
        assert rc == 2 and "HETHUB_HOST: 'elsewhere' is not a host of the plan's cluster (fast, slow)" in err, err
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_show_on_a_directory_without_plans_is_one_line(tmp_path, capsys):
    from cli_util import cli_error
    assert "is a directory, not a file" in cli_error(capsys, ["show", str(tmp_path)])
