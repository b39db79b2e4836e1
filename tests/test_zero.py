"""Tier 2: ZeRO-1 inside each stage (hethub.zero) trains exactly like one process, shards the optimizer
state over a stage's replicas, and its checkpoints resume without ZeRO under another plan."""
import os

import pytest
import torch

from dist_util import run_plan, run_python, spawn
from plans import CASES, stack_plan, write_plan

pytestmark = pytest.mark.dist
WORKER = os.path.join("tests", "workers", "resume.py")
K = 3
PLANS = {"2to3": ([3], [[3, 3], [2, 2, 2]], 6, 2), "2to1to3": ([2, 5], [[3, 3], [6], [2, 2, 2]], 6, 2)}
# float32 with Adam: the stage's replicas sum gradients in another order than one process (~1e-7 relative),
# and Adam's division by sqrt(v) moves a weight by up to ~1e-3 of its lr-sized step (lr 0.01): 1e-5.
TOL = 1e-5


def _run(tmp_path, plan, name, first, last, *extra):
    return run_plan(tmp_path, plan, name, WORKER, str(first), str(last), "adam", "0.05", *extra, timeout=120)


def _reference(tmp_path, last):
    out = str(tmp_path / "ref.pt")
    r = run_python([WORKER, "single", out, "0", str(last), "adam", "0.05"], timeout=60)
    assert r.returncode == 0, r.stderr
    return torch.load(out, weights_only=True)


def _compare(got, ref, losses):
    seen = set()
    for g in got:
        torch.testing.assert_close(g["losses"], losses, rtol=TOL, atol=0)
        for k, v in g["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=TOL, atol=TOL)
            seen.add(k)
    assert seen == set(ref["params"])


def _check_shards(plan, got, ref):
    for st in plan.stages:
        # Adam keeps two fp32 moments per element and a step per tensor; ZeRO-1 splits the stage's flattened
        # parameters element by element: replica j holds elements [j c, (j+1) c), c = ceil(n / width).
        params = [p for i in range(*st.layers) for p in ref["params"] if p.startswith(f"{i}.")]
        n = sum(ref["params"][p].numel() for p in params)
        share = [got[r.rank]["opt_bytes"] for r in st.replicas]
        if st.width == 1:
            assert share == [2 * 4 * n + 4 * len(params)], (st.index, share)
            continue
        c = -(-n // st.width)
        assert share == [2 * 4 * (min(n, (j + 1) * c) - min(n, j * c)) + 4 for j in range(st.width)], (st.index, share)


def test_zero1_trains_like_one_process_and_checkpoints_resume_without_zero_and_back(tmp_path):
    """Adam with clipping. 2 -> 3 with ZeRO-1 for K steps, saved; 1 -> 2 -> 1 without ZeRO resumes from it for
    K steps and saves; 2 -> 1 -> 3 with ZeRO-1 resumes from that for 10 more. Every run equals one process
    trained without a break, and ZeRO-1's optimizer state is split element by element."""
    K, L = 5, 10
    ckpt, ckpt2, plan_a, plan_c = (str(tmp_path / "ckpt"), str(tmp_path / "ckpt2"), stack_plan(*PLANS["2to3"]),
                                   stack_plan(*PLANS["2to1to3"]))
    first = _run(tmp_path, plan_a, "a", 0, K, "--zero1", "--save", ckpt)
    second = _run(tmp_path, stack_plan([2, 5], [[6], [4, 2], [6]], 6, 2), "b", K, 2 * K, "--load", ckpt,
                  "--save", ckpt2)
    third = _run(tmp_path, plan_c, "c", 2 * K, 2 * K + L, "--load", ckpt2, "--zero1")
    ref = _reference(tmp_path, 2 * K + L)
    for g in first:
        torch.testing.assert_close(g["losses"], ref["losses"][:K], rtol=TOL, atol=0)
    _check_shards(plan_a, first, ref)
    for g in second:
        torch.testing.assert_close(g["losses"], ref["losses"][K:2 * K], rtol=TOL, atol=0)
    _compare(third, ref, ref["losses"][2 * K:])
    _check_shards(plan_c, third, ref)


def test_optimizer_state_per_rank_is_the_cost_models_figure(tmp_path):
    """hethub's GPT layers, widths 1, 2 (uneven split 4+2) and 3: each rank's Adam state (sum of its state
    tensors, measured after a step) is CostModel.optimizer_state_bytes within 5% (the memory model charges it)."""
    import json
    from hethub.partitioner.costmodel import CostModel
    from hethub.partitioner.placement import StageLayout, build_plan
    from hethub.partitioner.records import ModelConfig
    from plans import CPU_CLUSTER
    m = ModelConfig(name="gpt-mem", architecture="gpt", num_layers=4, hidden_size=32, num_attention_heads=2,
                    ffn_hidden_size=64, vocab_size=64, seq_length=8)
    plan = build_plan(m, CPU_CLUSTER, [StageLayout((0, 2), "CPU", (6,)), StageLayout((2, 4), "CPU", (4, 2)),
                                       StageLayout((4, 6), "CPU", (2, 2, 2))], 6, 2)
    path = write_plan(tmp_path, plan)
    out = str(tmp_path / "mem{rank}.json")
    for rank, (rc, _o, err) in enumerate(spawn(plan.world_size, [os.path.join("tests", "workers", "zero_memory.py"),
                                                                  path, out], timeout=120)):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"
    cm = CostModel(CPU_CLUSTER, m, dtype="fp32", zero1=True)
    for st in plan.stages:
        figure = cm.optimizer_state_bytes(*st.layers, st.width)
        for r in st.replicas:
            with open(out.replace("{rank}", str(r.rank))) as f:
                measured = json.load(f)["opt_bytes"]
            assert measured == pytest.approx(figure, rel=0.05), (st.index, r.rank, measured, figure)
    whole = CostModel(CPU_CLUSTER, m, dtype="fp32").optimizer_state_bytes(4, 6)
    assert cm.optimizer_state_bytes(4, 6, 3) == pytest.approx(whole / 3, rel=1e-3)  # the point of ZeRO-1


@pytest.mark.parametrize("zero,plan_zero1,fragment", [
    (2, False, "error: config.zero_optimization.stage: hethub runs ZeRO stage 0 or 1"),
    (0, True, "error: config.zero_optimization.stage: the plan was made with --zero1"),
])
def test_unsupported_zero_is_refused_on_every_rank(tmp_path, zero, plan_zero1, fragment):
    plan = stack_plan(*CASES["1to2"]).model_copy(update={"zero1": plan_zero1})
    path = write_plan(tmp_path, plan)
    code = ("import sys, torch; sys.path.insert(0, 'tests/workers'); import train_stack as t, hethub\n"
            f"cfg = {{'zero_optimization': {{'stage': {zero}}}}}\n"
            f"hethub.initialize(layers=t.make_layers(7), loss_fn=t.loss_fn, config=cfg, plan={path!r},\n"
            "                  optimizer=lambda ps: torch.optim.Adam(ps))\n")
    for rc, _out, err in spawn(3, ["-c", code], timeout=60):
        assert rc == 2 and err.strip().splitlines()[-1].startswith(fragment), err[-1500:]


def test_a_stage_of_its_own_shards_only_itself_and_trains_like_one_process(tmp_path):
    """A plan that marks one stage zero1 (no ZeRO in ds_config): that stage's optimizer state is split over
    its replicas, the other stages of width > 1 keep whole state, and the run equals one process."""
    plan = stack_plan(*PLANS["2to1to3"])
    stages = [st.model_copy(update={"zero1": st.index == 2}) for st in plan.stages]
    plan = plan.model_copy(update={"stages": stages})
    got = _run(tmp_path, plan, "s", 0, K)
    ref = _reference(tmp_path, K)
    _compare(got, ref, ref["losses"])
    sharded = plan.model_copy(update={"stages": [plan.stages[2]]})
    _check_shards(sharded, got, ref)
    first = plan.stages[0]
    params = [p for i in range(*first.layers) for p in ref["params"] if p.startswith(f"{i}.")]
    n = sum(ref["params"][p].numel() for p in params)
    assert [got[r.rank]["opt_bytes"] for r in first.replicas] == [2 * 4 * n + 4 * len(params)] * first.width
