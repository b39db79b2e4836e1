"""Tensor parallelism inside a stage: plan format and validation, cost model terms, the planner's choice."""
import json
import re

import pytest

from hethub.partitioner import Cluster, InputError, Plan, builtin_model
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.planner import PlannerOptions, search
from hethub.partitioner.search.candidates import tensor_parallel_degrees
from hethub.partitioner.records import ModelConfig

NODE8 = Cluster.model_validate({"name": "a100x16", "nodes": [{"host": "n0", "device_type": "A100-80GB", "count": 8},
                                                            {"host": "n1", "device_type": "A100-80GB", "count": 8}]})
GPT = ModelConfig(name="gpt-mini", architecture="gpt", num_layers=4, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, vocab_size=128, seq_length=16)


def tp_plan(t=2, widths=(1, 2)) -> Plan:
    layouts = [StageLayout((0, 3), "A100-80GB", (4,) if widths[0] == 1 else (2, 2), tensor_parallel=t),
               StageLayout((3, 6), "A100-80GB", tuple([4 // widths[1]] * widths[1]), tensor_parallel=t)]
    return build_plan(GPT, NODE8, layouts, 4, 2)


def test_a_tensor_parallel_replica_lists_its_ranks_and_slots_and_round_trips():
    plan = tp_plan()
    rep = json.loads(plan.to_json())["stages"][1]["replicas"][0]
    assert set(rep) == {"ranks", "host", "slots", "samples"} and len(rep["ranks"]) == 2  # the contract's form
    assert Plan.model_validate_json(plan.to_json()) == plan
    assert plan.world_size == 6 and plan.locate(rep["ranks"][1]) == (1, 0)
    r = plan.stages[1].replicas[0]
    assert (r.rank, r.slot) == (r.ranks[0], r.slots[0])  # the lead


@pytest.mark.parametrize("edit,match", [
    # one rank makes a replica of degree 1 (per-replica tensor parallelism): its two slots are then one too many
    (lambda d: d["stages"][1]["replicas"][0].update(ranks=[2]), r"stages\[1\]\.replicas\[0\]\.slots: a replica of "
                                                                  r"1 rank\(s\) lists 1 slots, got 2"),
    (lambda d: d["stages"][1]["replicas"][0].update(slots=[2, 9]), r"replicas\[0\]\.slots: host 'n0' has slots 0\.\.7, "
                                                                   r"got 9"),
    (lambda d: d["stages"][1]["replicas"][1].update(slots=[0, 1]), r"replicas\[1\]\.slot: n0:0 is already used"),
    (lambda d: [s.update(tensor_parallel=3) for s in d["stages"]], r"stages\[0\]\.tensor_parallel: 3 must divide the "
                                                                   r"model's attention heads \(4\)"),
])
def test_bad_tensor_parallel_plans_name_the_field(edit, match):
    data = json.loads(tp_plan().to_json())
    edit(data)
    with pytest.raises(InputError, match=match):
        Plan.from_json(json.dumps(data))


def test_cost_model_splits_blocks_and_prices_the_all_reduces():
    m = builtin_model("gpt-1.3b")
    cm = CostModel(NODE8, m)
    f1, b1 = cm.stage_compute_s("A100-80GB", 1, 5, 4)
    f2, b2 = cm.stage_compute_s("A100-80GB", 1, 5, 4, tp=2)
    gbps, lat = cm._link_gbps("A100-80GB", "A100-80GB", True)
    # per block and pass: two ring all-reduces of 4 samples x s x h 16-bit values, 2 (t-1)/t of it each on the link
    ar = 4 * (2 * (2 * (2 - 1) / 2) * (4 * m.seq_length * m.hidden_size * 2) * 8 / (gbps * 1e9) + 2 * 2 * (2 - 1) * lat)
    assert f2 == pytest.approx(f1 / 2 + ar) and b2 == pytest.approx(b1 / 2 + ar)
    # the embedding and the head run whole on every rank of the group
    n = m.num_planner_layers
    assert cm.stage_compute_s("A100-80GB", n - 1, n, 4, tp=4)[0] == cm.stage_compute_s("A100-80GB", n - 1, n, 4)[0]
    # parameters: the split matrices t ways, norms and row-parallel biases whole
    p1, p4 = cm.stage_params(1, 5), cm.stage_params(1, 5, tp=4)
    assert p1 / 4 < p4 < p1 / 4 * 1.01
    assert cm.state_bytes(1, 5, tp=4) < cm.state_bytes(1, 5) / 3.9 and cm.act_bytes(4)[1:5].sum() < cm.act_bytes()[1:5].sum()


def test_the_timeline_shows_the_tensor_parallel_all_reduces():
    from hethub.partitioner.simulator import simulate
    plan = tp_plan()
    cm = CostModel(NODE8, GPT)
    res = simulate(plan, cm)
    tp_events = [e for e in res.events if e.kind == "tp"]
    lead = plan.stages[0].replicas[0].rank
    mine = [e for e in tp_events if e.rank == lead and e.name == "TP all-reduce F0"]
    assert len(mine) == 1
    want, _ = cm.stage_tp_allreduce_s("A100-80GB", 0, 3, 4, False, 2)
    assert mine[0].end_s - mine[0].start_s == pytest.approx(want) and want > 0
    f0 = next(e for e in res.events if e.rank == lead and e.name == "F0")
    assert f0.start_s <= mine[0].start_s and mine[0].end_s == pytest.approx(f0.end_s)  # inside the forward
    assert any(ev.get("cat") == "tp" for ev in res.chrome_trace(plan)["traceEvents"])


def test_degrees_fit_a_node_and_divide_the_model():
    cm = CostModel(NODE8, builtin_model("llama-70b"))  # 64 heads, 8 KV heads
    assert tensor_parallel_degrees(cm, "A100-80GB", 8) == [1, 2, 4, 8]
    assert tensor_parallel_degrees(cm, "A100-80GB", 1) == [1]
    three = Cluster.model_validate({"name": "n3", "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 3}]})
    assert tensor_parallel_degrees(CostModel(three, builtin_model("llama-70b")), "A100-80GB", 8) == [1, 2]


def test_planner_uses_tensor_parallelism_and_is_never_slower_for_it():
    """llama-70b on 32 A100-80GB: without TP every replica holds whole layers, so memory forces a deep pipeline;
    with TP up to 8 the planner splits blocks within a node, and the plan it finds is never slower."""
    four = Cluster.model_validate({"name": "a100x32", "nodes": [{"host": f"n{k}", "device_type": "A100-80GB",
                                                                "count": 8} for k in range(4)]})
    cm = CostModel(four, builtin_model("llama-70b"))
    on, _ = search(cm, 64, PlannerOptions(time_limit_s=30, max_micro_batch_size=4))
    off, _ = search(cm, 64, PlannerOptions(time_limit_s=30, max_micro_batch_size=4, max_tensor_parallel=1))
    assert on.objective <= off.objective * (1 + 1e-9)
    assert any(int(t) > 1 for t in on.cands.tp[on.chosen])


# ---------------------------------------------------------------------------------------------- runtime (dist)
import os  # noqa: E402

import torch  # noqa: E402

from dist_util import run_plan, run_python, spawn  # noqa: E402
from plans import stack_layers  # noqa: E402

WORKER = os.path.join("tests", "workers", "train_tp.py")
TINY = ModelConfig(name="gpt-tp", architecture="gpt", num_layers=4, hidden_size=32, num_attention_heads=4,
                   ffn_hidden_size=64, vocab_size=64, seq_length=8)
TOL = 1e-9  # float64 throughout: only the order of sums differs


def _cpu_plan(model, stages, mb=6, M=2):
    from plans import CPU_CLUSTER
    # a stage is (layers, samples, tensor_parallel[, recompute])
    return build_plan(model, CPU_CLUSTER, [StageLayout(l, "CPU", s, tensor_parallel=t, recompute=bool(r and r[0]))
                                           for l, s, t, *r in stages], mb, M)


def _run(tmp_path, plan, name, steps, kind, *extra):
    return run_plan(tmp_path, plan, name, WORKER, str(steps), kind, *extra)


def _reference(tmp_path, plan, steps, kind):
    return _reference_args(tmp_path, plan, steps, kind)


def _reference_args(tmp_path, plan, steps, kind, *extra):
    path, out = str(tmp_path / "ref.json"), str(tmp_path / f"ref{'-'.join(extra)}.pt")
    with open(path, "w") as f:
        f.write(plan.to_json())
    r = run_python([WORKER, path, out, str(steps), kind, "single", *extra], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _compare(got, ref, losses):
    seen = set()
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["losses"], losses, rtol=TOL, atol=0)
        for k, v in g["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=0, atol=TOL, msg=f"rank {rank} {k}")
            seen.add(k)
    assert seen == set(ref["params"])


@pytest.mark.dist
def test_gpt_blocks_train_tensor_parallel_and_resume_under_another_degree(tmp_path):
    """hethub's GPT blocks, SGD with clipping, float64: 5 steps under (t=2, w=1) -> (t=2, w=2), saved (whole
    tensors); 5 more under (t=1, w=2) -> (t=2, w=1, recompute: DTensor blocks under activation checkpointing)
    -> (t=1, w=3, uneven 3+2+1): both equal one process."""
    K, ckpt = 5, str(tmp_path / "ckpt")
    a = _cpu_plan(TINY, [((0, 3), (6,), 2), ((3, 6), (3, 3), 2)])
    b = _cpu_plan(TINY, [((0, 2), (3, 3), 1), ((2, 4), (6,), 2, True), ((4, 6), (3, 2, 1), 1)])
    ref = _reference(tmp_path, a, 2 * K, "gpt")
    first = _run(tmp_path, a, "a", K, "gpt", "--save", ckpt)
    for g in first:
        torch.testing.assert_close(g["losses"], ref["losses"][:K], rtol=TOL, atol=0)
    layer = torch.load(os.path.join(ckpt, f"global_step{K}", "layer_01-model_states.pt"), weights_only=True)
    assert layer["attn.q.weight"].shape == (32, 32) and layer["fc1.weight"].shape == (64, 32)  # whole, not shards
    second = _run(tmp_path, b, "b", 2 * K, "gpt", "--first", str(K), "--load", ckpt)
    _compare(second, ref, ref["losses"][K:])


@pytest.mark.dist
def test_user_layers_split_by_a_tp_plan_train_like_one_process(tmp_path):
    """A user's Linear-Tanh-Linear layers with tp_plan {"*.0": "colwise", "*.2": "rowwise"} in a stage of two
    tensor-parallel replicas (uneven 4+2) between two whole stages, with ZeRO-1 over the replicas that hold
    the same shard: 6 steps equal one process. Then the same under bf16 autocast, within 1e-2."""
    m = ModelConfig(name="stack", architecture="gpt", num_layers=3, hidden_size=16, num_attention_heads=2,
                    ffn_hidden_size=32, vocab_size=8, seq_length=1)
    plan = _cpu_plan(m, [((0, 1), (6,), 1), ((1, 4), (4, 2), 2), ((4, 5), (6,), 1)])
    ref = _reference(tmp_path, plan, 6, "user")
    _compare(_run(tmp_path, plan, "u", 6, "user", "zero1"), ref, ref["losses"])
    # bf16 autocast under tensor parallelism: fp32 weights, within bf16's tolerance of the same autocast in one
    # process (only GEMM blocking over sliced rows and split columns differs), and really not fp64's numbers
    bf16 = _run(tmp_path, plan, "b", 6, "user", "bf16")
    ref16 = _reference_args(tmp_path, plan, 6, "user", "bf16")
    for g in bf16:
        torch.testing.assert_close(g["losses"], ref16["losses"], rtol=1e-2, atol=0)
        for k, v in g["params"].items():
            assert v.dtype == torch.float32
            torch.testing.assert_close(v, ref16["params"][k], rtol=0, atol=1e-2)
    assert not torch.allclose(ref16["losses"], ref["losses"], rtol=1e-6, atol=0)


@pytest.mark.dist
def test_zb_h1_splits_tensor_parallel_and_gpt_stages_and_trains_like_one_process(tmp_path):
    """Schedule zb-h1 on tensor-parallel stages (the weights are DTensors, ZeRO-1 over the replicas) and on
    hethub's GPT blocks (attention, a head tied to the embedding): B sends input gradients, W adds the
    weights' later, and the run equals one process in float64."""
    m = ModelConfig(name="stack", architecture="gpt", num_layers=3, hidden_size=16, num_attention_heads=2,
                    ffn_hidden_size=32, vocab_size=8, seq_length=1)
    plan = _cpu_plan(m, [((0, 1), (6,), 1), ((1, 4), (4, 2), 2), ((4, 5), (6,), 1)], M=3)
    plan = plan.model_copy(update={"schedule": "zb-h1"})
    ref = _reference(tmp_path, plan, 4, "user")
    _compare(_run(tmp_path, plan, "u", 4, "user", "zero1"), ref, ref["losses"])
    gpt = _cpu_plan(TINY, [((0, 2), (3, 3), 1), ((2, 4), (6,), 2), ((4, 6), (3, 2, 1), 1)], M=3)
    gpt = gpt.model_copy(update={"schedule": "zb-h1"})
    ref = _reference(tmp_path, gpt, 4, "gpt")
    _compare(_run(tmp_path, gpt, "g", 4, "gpt"), ref, ref["losses"])


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_chunked_schedules_on_tensor_parallel_groups_with_a_tied_head_train_like_one_process(tmp_path, schedule):
    """hethub's GPT blocks (a head tied to the embedding) in float64, groups of two chunks, the last group a
    tensor-parallel replica, ZeRO-1 over the first group's replicas. zb-v: group 0 holds the embedding and the
    head (a tie inside one group, across its two chunks) and the tensor-parallel group holds the turn (its ranks
    hand their rows to themselves); interleaved: the tie spans groups 0 and 2, every boundary crosses groups."""
    from hethub.partitioner.chunked import rechunk
    base = _cpu_plan(TINY, [((0, 2), (3, 3), 1), ((2, 4), (3, 2, 1), 1), ((4, 6), (6,), 2)], M=4)
    plan = rechunk(base, schedule, 2)
    holders = {c.group for c in plan.pipeline if c.first == 0 or c.last == TINY.num_planner_layers}
    assert (holders == {0}) == (schedule == "zb-v")
    ref = _reference(tmp_path, plan, 4, "gpt")
    _compare(_run(tmp_path, plan, "c", 4, "gpt", "zero1"), ref, ref["losses"])


BAD_TP_PLANS = [
    ({"*.0": "colwise", "*.2": "diagonal"}, "tp_plan['*.2']: expected 'colwise' or 'rowwise', got 'diagonal'"),
    ({"*.0": "colwise", "*.9": "rowwise"}, "tp_plan['*.9']: matches no submodule of a stage with tensor_parallel > 1"),
    ({}, "layers[1]: Sequential in stage 1 (tensor_parallel 2) has no tensor-parallel plan"),
]


def _stack_tp_plan():
    m = ModelConfig(name="stack", architecture="gpt", num_layers=1, hidden_size=16, num_attention_heads=2,
                    ffn_hidden_size=32, vocab_size=8, seq_length=1)
    return _cpu_plan(m, [((0, 1), (2,), 1), ((1, 2), (2,), 2), ((2, 3), (2,), 1)], mb=2, M=1)


@pytest.mark.parametrize("tp_plan,message", BAD_TP_PLANS)
def test_a_bad_tp_plan_names_the_entry_or_layer(tp_plan, message):
    from hethub.runtime import tp
    with pytest.raises(InputError) as err:
        tp.check_layers(_stack_tp_plan(), stack_layers(), tp.check_tp_plan(tp_plan))
    assert str(err.value).startswith(message)


@pytest.mark.dist
def test_a_bad_tp_plan_ends_every_rank_with_exit_2_before_any_collective(tmp_path):
    tp_plan, message = BAD_TP_PLANS[1]
    plan = _stack_tp_plan()
    path = str(tmp_path / "plan.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    code = ("import sys, torch; from torch import nn; sys.path.insert(0, 'tests'); import hethub\n"
            "from plans import stack_layers\n"
            f"hethub.initialize(layers=stack_layers(), loss_fn=nn.functional.mse_loss, plan={path!r},\n"
            f"                  tp_plan={tp_plan!r}, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))\n")
    for rc, _out, err in spawn(plan.world_size, ["-c", code], timeout=60):
        assert rc == 2 and err.strip().splitlines()[-1].startswith("error: " + message), err[-1500:]


# ------------------------------------------------------------------ replicas of different degrees in one stage
MIXED = ModelConfig(name="gpt-mixed-tp", architecture="gpt", num_layers=3, hidden_size=24, num_attention_heads=6,
                    ffn_hidden_size=48, vocab_size=64, seq_length=8)


def mixed_tp_plan(degrees=(1, 2, 3), samples=(1, 2, 3), zero1=False) -> Plan:
    """Stage 0: layers [0, 2) on rank 0. Stage 1: layers [2, 5), one replica per degree (ranks after rank 0, in
    order), each taking its samples of the micro-batch of 6."""
    reps, rank = [], 1
    for t, n in zip(degrees, samples):
        reps.append({"ranks": list(range(rank, rank + t)), "host": "localhost", "slots": list(range(rank, rank + t)),
                     "samples": n})
        rank += t
    data = {"model": MIXED.model_dump(), "cluster": CPU_CLUSTER_DUMP(), "global_batch_size": 12,
            "micro_batch_size": 6, "num_micro_batches": 2, "zero1": zero1,
            "stages": [{"index": 0, "layers": [0, 2], "device_type": "CPU", "tensor_parallel": 1,
                        "replicas": [{"rank": 0, "host": "localhost", "slot": 0, "samples": 6}]},
                       {"index": 1, "layers": [2, 5], "device_type": "CPU", "tensor_parallel": max(degrees),
                        "replicas": reps}]}
    return Plan.model_validate(data)


def CPU_CLUSTER_DUMP():
    from plans import CPU_CLUSTER
    return CPU_CLUSTER.model_dump()


def test_a_stage_may_mix_tensor_parallel_degrees_and_says_so():
    plan = mixed_tp_plan()
    st = plan.stages[1]
    assert st.degrees == [1, 2, 3] and not st.uniform_tp and plan.world_size == 7
    assert Plan.model_validate_json(plan.to_json()) == plan
    assert plan.locate(5) == (1, 2) and st.ranks_of(st.replicas[0]) == [1]
    from hethub.partitioner.groups import group_specs
    specs = group_specs(plan)
    assert [s.ranks for s in specs if s.purpose == "tp"] == [(2, 3), (4, 5, 6)]
    # shards of halves and thirds do not align: one reduce group of every rank of the stage
    assert [s.ranks for s in specs if s.purpose == "dp" and s.stage == 1] == [(1, 2, 3, 4, 5, 6)]
    from hethub.cli.show import plan_table
    from rich.console import Console
    console = Console(width=200, record=True)
    console.print(plan_table(plan))
    assert "1+2+3" in console.export_text()
    # the simulator runs each replica at its own degree: its forward takes its share of the work at that degree
    from hethub.partitioner.simulator import simulate
    cm = CostModel(plan.cluster, plan.model)
    events = simulate(plan, cm).events
    for rank, t, n in ((1, 1, 1), (2, 2, 2), (4, 3, 3)):
        fwd = next(e for e in events if e.rank == rank and e.name == "F0")
        f, _b = cm.stage_compute_s("CPU", 2, 5, n, tp=t)
        assert fwd.end_s - fwd.start_s == pytest.approx(f), (rank, fwd)


def test_simulate_prints_a_tiny_plans_rate_without_an_exponent(tmp_path):
    from conftest import run_cli
    path = tmp_path / "p.json"
    path.write_text(mixed_tp_plan().to_json())
    r = run_cli("simulate", str(path))
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("iteration "))
    assert re.search(r", \d{1,3}(,\d{3})+ samples/s,", line) and "e+" not in line, line  # 25,671, not 2.567e+04


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["stages"][1].update(tensor_parallel=2), r"stages\[1\]\.tensor_parallel: a stage whose replicas "
                                                          r"differ in tensor parallelism \(1/2/3\) names the largest "
                                                          r"degree, 3, got 2"),
    (lambda d: d["model"].update(num_attention_heads=4, hidden_size=16), r"stages\[1\]\.(tensor_parallel|replicas\[2\]"
                                                                          r"\.ranks): 3 must divide the model's "
                                                                          r"attention heads \(4\)"),
    (lambda d: d["stages"][1]["replicas"][1].update(samples=3), r"stages\[1\]\.replicas: samples must sum to "
                                                               r"micro_batch_size=6, got 7"),
    (lambda d: d["stages"][1]["replicas"][1].update(slots=[2]), r"stages\[1\]\.replicas\[1\]\.slots: a replica of 2 "
                                                               r"rank\(s\) lists 2 slots, got 1"),
])
def test_bad_mixed_degree_plans_name_the_field(edit, match):
    data = json.loads(mixed_tp_plan().to_json())
    edit(data)
    with pytest.raises(InputError, match=match):
        Plan.from_json(json.dumps(data))


def test_zero1_in_a_stage_of_mixed_degrees_is_priced_as_it_runs():
    """ZeRO-1 in a stage of degrees 1/2/3 shards the whole tensors' state over its six ranks (hethub.runtime.zero),
    so a rank holds ceil(n / 6) of its n whole parameters' state, not a replica's shard over three replicas."""
    import math
    from hethub.dsconfig import check_zero
    from hethub.partitioner.evaluate import group_memory_bytes
    plan = mixed_tp_plan(zero1=True)
    check_zero(plan, {"zero_optimization": {"stage": 1}})  # accepted (it was refused)
    st, cm = plan.stages[1], CostModel(plan.cluster, plan.model)
    assert (plan.stages[0].whole_state_ranks, st.whole_state_ranks) == (0, 6)
    whole = int(cm.stage_params(2, 5, 1))
    per_param = cm.optimizer_state_bytes(2, 5) / whole
    assert cm.optimizer_state_bytes(2, 5, st.width, 1, True, (whole, 6)) == pytest.approx(math.ceil(whole / 6) * per_param)
    saved = group_memory_bytes(mixed_tp_plan(), cm, 1, 3) - group_memory_bytes(plan, cm, 1, 3)
    assert saved == pytest.approx((whole - math.ceil(whole / 6)) * per_param)


def test_the_planner_mixes_degrees_in_a_stage_where_that_wins(monkeypatch):
    """One A100-80GB beside four V100-16GB (gpt-1.3b, 1F1B): the best plan is one stage of the A100 at TP 1 and the
    V100s as one group at TP 4, faster than the best plan the search finds without such stages."""
    from hethub.partitioner.api import make_plan
    from hethub.partitioner.search import candidates as cands
    cluster = Cluster.model_validate({"name": "a-v", "nodes": [
        {"host": "a", "device_type": "A100-80GB", "count": 1}, {"host": "v", "device_type": "V100-16GB", "count": 4}],
        "network": {"intra_node_gbps": 2400, "inter_node_gbps": 100}})
    opts = PlannerOptions(time_limit_s=20, schedule="1f1b")
    plan = make_plan(cluster, builtin_model("gpt-1.3b"), 16, opts=opts, with_homogeneous_sum=False)
    assert [(st.types, st.degrees) for st in plan.stages] == [(["A100-80GB", "V100-16GB"], [1, 4])], plan.stages
    assert Plan.model_validate_json(plan.to_json()) == plan
    add = cands._Builder.add

    def without_mixed_degrees(self, pa, wa, sa, pb=None, wb=0, sb=0, **kw):
        if pb is None or pb.tp == pa.tp:
            add(self, pa, wa, sa, pb, wb, sb, **kw)
    monkeypatch.setattr(cands._Builder, "add", without_mixed_degrees)
    other = make_plan(cluster, builtin_model("gpt-1.3b"), 16, opts=opts, with_homogeneous_sum=False)
    assert all(st.uniform_tp for st in other.stages)
    assert plan.predicted.samples_per_s > other.predicted.samples_per_s


@pytest.mark.dist
def test_a_stage_mixing_tensor_parallel_degrees_trains_like_one_process_with_and_without_zero1(tmp_path):
    """hethub's GPT blocks in float64, SGD with momentum, on a stage of three replicas at TP 1, 2 and 3 (1, 2 and 3
    samples of each micro-batch). Steps [0, 3) without ZeRO-1, saved; [3, 6) resumed under ZeRO-1, which shards the
    whole tensors' momentum over the stage's six ranks, saved; [6, 9) resumed under a stage of one degree (TP 2
    twice) with ZeRO-1 over its replicas. Every part equals one process."""
    K, first, second = 3, str(tmp_path / "ckpt1"), str(tmp_path / "ckpt2")
    plan = mixed_tp_plan()
    ref = _reference_args(tmp_path, plan, 3 * K, "gpt", "momentum")
    plain = _run(tmp_path, plan, "m", K, "gpt", "momentum", "--save", first)
    for g in plain:
        torch.testing.assert_close(g["losses"], ref["losses"][:K], rtol=TOL, atol=0)
    for rank in (1, 2, 4):  # every replica's lead holds the one-process weights after K steps
        for k, v in plain[rank]["params"].items():
            assert v.shape == ref["params"][k].shape
    sharded = _run(tmp_path, plan, "z", 2 * K, "gpt", "momentum", "zero1", "--first", str(K), "--load", first,
                   "--save", second)
    for g in sharded:
        torch.testing.assert_close(g["losses"], ref["losses"][K:2 * K], rtol=TOL, atol=0)
    whole = sum(v.numel() for k, v in ref["params"].items() if int(k.split(".")[0]) >= 2)  # stage 1's parameters
    # momentum: at most ceil(whole / 6) elements a rank, every element of stage 1's whole tensors once
    assert [plain[r]["state_elements"] >= whole // 3 for r in range(1, 7)] == [True] * 6
    assert [sharded[r]["state_elements"] <= -(-whole // 6) for r in range(1, 7)] == [True] * 6
    assert sum(sharded[r]["state_elements"] for r in range(1, 7)) == whole
    last = _run(tmp_path, mixed_tp_plan((2, 2), (4, 2)), "u", 3 * K, "gpt", "momentum", "zero1", "--first",
                str(2 * K), "--load", second)
    _compare(last, ref, ref["losses"][2 * K:])
