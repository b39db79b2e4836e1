"""Tier 2 (multi-process gloo): heterogeneous plans train exactly like one process.

For each width pattern, N steps of SGD with gradient clipping on a small layer stack give the same
loss at every step (rel. 1e-5) and the same final weights (abs. 1e-5) as a single process training
the same layers on the same global batches. SGD, not Adam: Adam hides gradient-scale errors.
"""
import re

import pytest
import torch

from dist_util import run_python, spawn
from hethub.partitioner.schedule import build_schedule
from plans import (CASES, CLIP, STEPS, WORKER, run_and_compare, single_process, stack_plan, write_plan,
                   write_schedule)

pytestmark = pytest.mark.dist

pytest.importorskip("deepspeed")

@pytest.mark.parametrize("name", [n for n in CASES if n not in ("1to2", "2to1")])  # both are inside 1to2to1
def test_equivalence_with_single_process(tmp_path, name):
    run_and_compare(tmp_path, stack_plan(*CASES[name]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["1to2to1"])
def test_zb_h1_split_backward_trains_like_one_process(tmp_path, name):
    """Schedule zb-h1: every stage after the first runs each backward as an input-gradient pass (B, whose
    result it sends at once) and a weight-gradient pass (W) later; the run still trains like one process."""
    plan = stack_plan(*CASES[name]).model_copy(update={"schedule": "zb-h1"})
    sched = build_schedule(plan)
    assert all(any(a.kind == "W" for a in sched[r.rank]) == (st.index > 0) for st in plan.stages for r in st.replicas)
    run_and_compare(tmp_path, plan, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recompute_stage_runs_its_forward_again_and_trains_like_one_process(tmp_path, schedule):
    """A plan's recompute stage checkpoints each layer (its input kept, its forward run again in the backward,
    as the cost model charges); under zb-h1 the split backward goes through the recomputed graph."""
    plan = stack_plan(*CASES["1to2to1"])
    plan = plan.model_copy(update={"schedule": schedule, "stages": [
        st.model_copy(update={"recompute": st.index == 1}) for st in plan.stages]})
    run_and_compare(tmp_path, plan, rtol=1e-5, atol=1e-5)
    per_run = STEPS * plan.num_micro_batches
    for st in plan.stages:
        for rep in st.replicas:
            got = torch.load(str(tmp_path / f"rank{rep.rank}.pt"), weights_only=True)["forwards"]
            assert got == per_run * (2 if st.recompute else 1), f"stage {st.index} rank {rep.rank}"


@pytest.mark.parametrize("wire,rtol", [("bf16", 2e-2), ("fp8", 0.15)])
def test_lossy_wire_dtype_through_the_bridge(tmp_path, wire, rtol):
    """A bf16/fp8 wire (cast in pack, up-cast in unpack) trains close to, but not exactly like, one process."""
    plan = stack_plan([3], [[3, 3], [2, 2, 2]], 6, 3, [{"after_stage": 0, "transport": "host", "dtype": wire}])
    got, ref = run_and_compare(tmp_path, plan, rtol=rtol, atol=rtol)
    assert not torch.equal(got["losses"], ref["losses"])  # the cast really happened


def _reordered(plan, keys_for_stage):
    """Each rank's actions of the plan's schedule, in the order keys_for_stage(stage, M) gives (kind, mb) keys."""
    out = {}
    for s, st in enumerate(plan.stages):
        for rep in st.replicas:
            acts = {(a.kind, a.mb): a for a in build_schedule(plan)[rep.rank]}
            out[rep.rank] = [acts[k] for k in keys_for_stage(s, plan.num_micro_batches) if k in acts]
    return out


def _gpipe(s, M):
    """Every forward, then every backward (GPipe order): deadlock-free with non-blocking transfers."""
    return ([("RA", j) for j in range(M)] + [k for j in range(M) for k in (("L", j), ("F", j), ("SA", j), ("RG", j))]
            + [k for j in range(M) for k in (("B", j), ("SG", j))] + [("AR", None), ("OPT", None)])


def _circular(s, M):
    """Stage 0 without warm-up, stage 1 GPipe: stage 1's F1 waits for stage 0's B0, which waits for stage 1's B0."""
    if s == 0:
        return [k for j in range(M) for k in (("L", j), ("F", j), ("SA", j), ("RG", j), ("B", j))] + \
            [("AR", None), ("OPT", None)]
    return _gpipe(s, M)


def test_hand_edited_schedule_runs_exactly_and_as_written(tmp_path):
    """A schedule file (ds_config hetero.schedule) replaces the plan's 1F1B: the ranks execute it action by
    action and still train exactly like one process."""
    plan = stack_plan(*CASES["1to2to1"])
    run_and_compare(tmp_path, plan, rtol=1e-5, atol=1e-5, sched=_reordered(plan, _gpipe))


def test_deadlocking_schedule_is_refused_before_launch_with_rank_and_step(tmp_path):
    plan = stack_plan(*CASES["1to2"])
    path = write_plan(tmp_path, plan)
    sched = write_schedule(tmp_path, _reordered(plan, _circular))
    results = spawn(plan.world_size, [WORKER, path, str(tmp_path / "r{rank}.pt"), "1", "0", f"schedule={sched}"],
                    timeout=60)
    for rc, _out, err in results:
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, err
        assert re.match(r"error: rank 0 step \d+: deadlock: B0 waits for data from rank\(s\) 1, 2", lines[0]), err


def test_plan_world_mismatch_exits_2_on_every_rank(tmp_path):
    plan = stack_plan(*CASES["2to3"])  # needs 5 ranks
    path = write_plan(tmp_path, plan)
    results = spawn(3, [WORKER, path, str(tmp_path / "r{rank}.pt"), "1", "0"], timeout=60)
    for rc, _out, err in results:
        assert rc == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: plan: plan needs world size 5 (2 + 3 ranks), "
                                                       "launched with 3"), err


def test_ranks_given_different_plans_all_exit_2_naming_them(tmp_path):
    """Each host reads its own plan.json: ranks 3 and 4 get a copy that splits stage 1's rows otherwise (a plan
    of the same world, valid on its own). The first collective finds it; no transfer is ever paired wrongly."""
    plan = stack_plan(*CASES["2to3"])
    other = stack_plan([3], [[3, 3], [1, 2, 3]], 6, 3)
    for rank in range(plan.world_size):
        (tmp_path / f"plan{rank}.json").write_text((other if rank >= 3 else plan).to_json())
    results = spawn(5, [WORKER, str(tmp_path / "plan{rank}.json"), str(tmp_path / "r{rank}.pt"), "1", "0"], timeout=60)
    for rc, _out, err in results:
        assert rc == 2 and err.strip().splitlines()[-1] == (
            "error: plan: rank(s) 3, 4 run another plan than rank 0 (each host reads its own copy: give every "
            "host the same plan file)"), err[-1500:]


def test_plan_from_ds_config_hetero_section(tmp_path):
    """`"hetero": {"plan": ...}` in ds_config works without a plan argument; a wrong batch key is refused."""
    plan = stack_plan(*CASES["1to2"])
    path = write_plan(tmp_path, plan)
    code = (
        "import sys, json, torch; sys.path.insert(0, 'tests/workers'); import train_stack as t, hethub\n"
        f"cfg = {{'hetero': {{'plan': {path!r}}}, 'train_batch_size': int(sys.argv[1])}}\n"
        "layers = t.make_layers(7)\n"
        "eng, *_ = hethub.initialize(layers=layers, loss_fn=t.loss_fn, config=cfg,\n"
        "                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))\n"
        "print('loss', float(eng.train_batch(iter([t.micro_batch(0, m, 4) for m in range(3)]))))\n")
    ok = spawn(3, ["-c", code, "12"], timeout=60)
    assert all(rc == 0 for rc, _, _ in ok), [e[-2000:] for _, _, e in ok]
    assert len({out for _, out, _ in ok}) == 1 and ok[0][1].startswith("loss ")
    bad = spawn(3, ["-c", code, "8"], timeout=60)
    for rc, _out, err in bad:
        assert rc == 2 and "error: config.train_batch_size: must agree with the plan (12" in err, err


def test_a_tensor_parallel_plan_launched_on_too_few_ranks_is_refused(tmp_path):
    data = stack_plan(*CASES["1to1"]).model_dump()
    data["model"]["num_attention_heads"] = 2  # so that 2 divides the heads
    data["stages"][1]["tensor_parallel"] = 2  # the replica becomes a group of 2 (ranks 1, 2)
    from hethub.partitioner import Plan
    path = write_plan(tmp_path, Plan.model_validate(data))
    results = spawn(2, [WORKER, path, str(tmp_path / "r{rank}.pt"), "1", "0"], timeout=60)
    for rc, _out, err in results:
        assert rc == 2 and err.strip().splitlines()[-1] == \
            "error: plan: plan needs world size 3 (1 + 1x2 ranks), launched with 2", err[-1500:]


def test_bf16_autocast_trains_like_one_process_within_bf16_tolerance(tmp_path):
    """"bf16": {"enabled": true}: autocast compute, fp32 weights/grads/optimizer, unequal widths, uneven split,
    clipping and ZeRO-1. The single-process reference runs the same autocast; only GEMM blocking over sliced
    rows differs."""
    plan = stack_plan(*CASES["uneven2to3"])
    plan_path = str(tmp_path / "plan.json")
    with open(plan_path, "w") as f:
        f.write(plan.to_json())
    results = spawn(plan.world_size, [WORKER, plan_path, str(tmp_path / "rank{rank}.pt"), str(STEPS), str(CLIP),
                                      "bf16", "zero1"], timeout=90)
    for rank, (rc, _out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"
    out = str(tmp_path / "single.pt")
    r = run_python([WORKER, plan_path, out, str(STEPS), str(CLIP), "single", "bf16"], timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = torch.load(out, weights_only=True)
    fp32 = single_process(tmp_path, plan_path)
    for rank in range(plan.world_size):
        got = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=True)
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-2, atol=0)
        for k, v in got["params"].items():
            assert v.dtype == torch.float32  # master weights stay fp32
            torch.testing.assert_close(v, ref["params"][k], rtol=0, atol=1e-2)
    assert not torch.allclose(ref["losses"], fp32["losses"], rtol=1e-6, atol=0)  # autocast really ran in bf16
    for rank in range(plan.world_size):  # one bf16 copy of each weight per step, not one per micro-batch
        got = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=True)
        casts = got["weight_casts"]
        assert len(casts) == STEPS and all(n == distinct > 0 for n, distinct in casts), (rank, casts)
        assert got["wire"] == ["torch.bfloat16"]  # boundaries cross in the training dtype the plan prices


@pytest.mark.parametrize("power", [20])
def test_fp16_with_dynamic_loss_scaling_trains_like_one_process(tmp_path, power):
    """"fp16": {"enabled": true}: fp16 autocast over fp32 weights and DeepSpeed's dynamic loss scale, from
    2**power (so that the first steps overflow): every rank skips the same steps as the one-process reference,
    halves the same scale, and trains within fp16 tolerance, under unequal widths, an uneven split and ZeRO-1."""
    plan = stack_plan(*CASES["uneven2to3"])
    plan_path = str(tmp_path / "plan.json")
    with open(plan_path, "w") as f:
        f.write(plan.to_json())
    results = spawn(plan.world_size, [WORKER, plan_path, str(tmp_path / "rank{rank}.pt"), str(STEPS), str(CLIP),
                                      f"fp16={power}", "zero1"], timeout=90)
    for rank, (rc, _out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"
    out = str(tmp_path / "single.pt")
    r = run_python([WORKER, plan_path, out, str(STEPS), str(CLIP), "single", f"fp16={power}"], timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = torch.load(out, weights_only=True)
    assert 0 < ref["skipped"] < STEPS  # the reference overflowed, then trained
    for rank in range(plan.world_size):
        got = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=True)
        assert (got["skipped"], got["loss_scale"]) == (ref["skipped"], ref["loss_scale"]), rank
        assert got["wire"] == ["torch.float16"]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=5e-3, atol=0)
        for k, v in got["params"].items():
            assert v.dtype == torch.float32
            torch.testing.assert_close(v, ref["params"][k], rtol=0, atol=5e-3)
