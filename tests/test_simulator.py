"""Tier 1: schedules as data, the event-level simulator, and its agreement with the closed form."""
import itertools
import json
import os
import re
import random

import pytest

from hethub.partitioner import Cluster, ModelConfig
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.evaluate import predict
from hethub.partitioner.placement import StageLayout, build_plan, even_split
from hethub.partitioner.schedule import Action, build_schedule, format_schedule, parse_schedule, stage_order
from hethub.partitioner.simulator import ScheduleError, simulate

CLUSTER = Cluster.model_validate({
    "name": "mix", "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 16},
                             {"host": "v", "device_type": "V100-32GB", "count": 16},
                             {"host": "t", "device_type": "T4", "count": 16}],
    "network": {"intra_node_gbps": 2400, "inter_node_gbps": 100}})
MODEL = ModelConfig(name="m", architecture="gpt", num_layers=10, hidden_size=1024, num_attention_heads=16,
                    ffn_hidden_size=4096, vocab_size=32000, seq_length=512)


def grid_plan(rng: random.Random, stages: int, mb: int, M: int):
    L = MODEL.num_planner_layers
    cuts = sorted(rng.sample(range(1, L), stages - 1))
    bounds = [0, *cuts, L]
    layouts = []
    for s in range(stages):
        w = rng.randint(1, min(4, mb))
        samples = even_split(mb, w) if rng.random() < 0.5 else _random_split(rng, mb, w)
        layouts.append(StageLayout((bounds[s], bounds[s + 1]), rng.choice(["A100-80GB", "V100-32GB", "T4"]),
                                   samples))
    return build_plan(MODEL, CLUSTER, layouts, mb, M)


def _random_split(rng, mb, w):
    cuts = sorted(rng.sample(range(1, mb), w - 1)) if w > 1 else []
    b = [0, *cuts, mb]
    return tuple(b[i + 1] - b[i] for i in range(w))


def test_actions_print_and_parse_back():
    text = "L0 F0 SA0>r5[0:2]>r6[2:4] RA1<r1[0:4] SG1>r1[0:4] RG0<r5[0:2]<r6[2:4] B0 W0 AR OPT"
    acts = parse_schedule(text)
    assert format_schedule(acts) == text
    assert acts[2].transfers[1].peer == 6 and acts[2].transfers[1].start == 2
    for bad in ["X1", "F", "SA1", "SA1<r2[0:1]", "AR3", "F1>r2[0:1]", "W", "W1>r2[0:1]"]:
        with pytest.raises(ValueError):
            Action.parse(bad)


@pytest.mark.parametrize("seed", range(12))
def test_schedule_invariants(seed):
    rng = random.Random(seed)
    plan = grid_plan(rng, rng.randint(1, 4), rng.choice([4, 6, 8]), rng.randint(1, 6))
    sched = build_schedule(plan)
    for rank, acts in sched.items():
        seen_f = set()
        for a in acts:
            if a.kind == "F":
                seen_f.add(a.mb)
            if a.kind == "B":
                assert a.mb in seen_f, f"rank {rank}: B{a.mb} before F{a.mb}"
        assert sorted(a.mb for a in acts if a.kind == "F") == list(range(plan.num_micro_batches))
        assert sorted(a.mb for a in acts if a.kind == "B") == list(range(plan.num_micro_batches))
    # every sample of every micro-batch is computed exactly once per stage
    for st in plan.stages:
        rows = sorted(r for a, b in st.sample_ranges() for r in range(a, b))
        assert rows == list(range(plan.micro_batch_size))
    # the simulator's matcher accepts it, and it runs without deadlock
    simulate(plan, CostModel(CLUSTER, MODEL), sched)


def test_compute_order_is_deepspeeds_1f1b():
    """Forwards and backwards run in DeepSpeed's TrainSchedule order (1F1B); only the transfers differ: hethub
    posts receives ahead and never blocks on a send."""
    schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for M, S in itertools.product([1, 2, 3, 5, 8], [1, 2, 3, 4]):
        for s in range(S):
            ds = schedule.TrainSchedule(micro_batches=M, stages=S, stage_id=s)
            buffers = ds.num_pipe_buffers()
            theirs = [("F" if isinstance(c, schedule.ForwardPass) else "B", c.buffer_id) for step in ds for c in step
                      if isinstance(c, (schedule.ForwardPass, schedule.BackwardPass))]
            ours = [(k, mb % buffers) for k, mb in stage_order(M, S, s) if k in ("F", "B")]
            assert ours == theirs, (M, S, s)


def test_receives_are_posted_ahead_and_bounded():
    """Stage s > 0 posts the receive of micro-batch j+1's activations before forward j (two in flight at most);
    gradients' receives are posted right after the forward that needs them."""
    for M, S in itertools.product([1, 3, 8], [2, 3, 4]):
        for s in range(1, S):
            order = stage_order(M, S, s)
            for j in range(M):
                f = order.index(("F", j))
                assert order.index(("RA", j)) < f
                if j + 1 < M:
                    assert order.index(("RA", j + 1)) < f
                posted = sum(1 for k, mb in order[:f] if k == "RA") - j
                assert posted <= 2
                if s < S - 1:
                    assert order.index(("RG", j)) == order.index(("SA", j)) + 1 == f + 2


def test_closed_form_matches_simulation_on_balanced_pipelines():
    """Equal stages (one type, equal widths and layer counts): the 1F1B closed form is exact to 5%."""
    cm = CostModel(CLUSTER, MODEL)
    worst = 0.0
    for stages, width, M in itertools.product([1, 2, 3, 4], [1, 2, 4], [1, 2, 4, 8, 16]):
        if (MODEL.num_planner_layers - 2) % stages:
            continue
        per = (MODEL.num_planner_layers - 2) // stages
        bounds = [0] + [1 + per * (s + 1) for s in range(stages - 1)] + [MODEL.num_planner_layers]
        layouts = [StageLayout((bounds[s], bounds[s + 1]), "A100-80GB", even_split(4, width)) for s in range(stages)]
        plan = build_plan(MODEL, CLUSTER, layouts, 4, M)
        worst = max(worst, abs(predict(plan, cm).iteration_s / simulate(plan, cm).iteration_s - 1))
    assert worst <= 0.05, worst


def test_closed_form_is_pessimistic_by_what_decoupled_stages_overlap():
    """Stages 1-4, widths 1-4, micro-batches 1-16, mixed types, uneven splits.

    With non-blocking transfers a stage mostly waits only for data, so the replay exceeds the closed form
    (M-1) max c + sum c (+ the slowest all-reduce and optimizer step) by at most 0.1% (a transfer queued behind an
    earlier one on its group, as NCCL runs them, can start late; 1e-5 here), and falls
    below it by at most what the closed form charges but decoupled stages overlap: stages downstream of
    the bottleneck run during its warm-up, transfers overlap compute, and all-reduces and optimizer
    steps of stages that finish early overlap the others' backwards.
    """
    cm = CostModel(CLUSTER, MODEL)
    rng = random.Random(0)
    from hethub.partitioner.evaluate import closed_form_s, stage_costs
    for stages in range(1, 5):
        for M in (1, 2, 4, 8, 16):
            for _ in range(4):
                plan = grid_plan(rng, stages, rng.choice([4, 8]), M)
                sim = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)  # the closed form leaves them out
                closed = closed_form_s(plan, cm)
                sc = stage_costs(plan, cm)
                costs = [c.per_micro_batch_s for c in sc]
                b = max(range(len(costs)), key=costs.__getitem__)
                overlappable = (sum(costs[b + 1:]) + sum(c.comm_s for c in sc) * M
                                + max(c.allreduce_s for c in sc) + max(c.optimizer_s for c in sc))
                assert sim <= closed * (1 + 1e-3)
                assert closed - sim <= overlappable + 1e-9


def _zb(plan):
    return plan.model_copy(update={"schedule": "zb-h1"})


def test_zb_h1_order_splits_every_backward_but_stage_zeros():
    """zb-h1: 1F1B's forwards and backwards in 1F1B's order; on stages s > 0 each B is followed (after its
    SG) by its W, except that the last stage runs B(M-1) before W(M-2)."""
    for M, S in itertools.product([1, 2, 3, 5], [1, 2, 3, 4]):
        for s in range(S):
            zb, base = stage_order(M, S, s, split=True), stage_order(M, S, s)
            assert [k for k in zb if k[0] != "W"] == base
            ws = [mb for k, mb in zb if k == "W"]
            if s == 0:
                assert ws == []
                continue
            assert sorted(ws) == list(range(M)) and zb.index(("W", M - 1)) == len(zb) - 3  # then AR, OPT
            for j in range(M - (2 if s == S - 1 and M >= 2 else 1)):
                assert zb.index(("W", j)) == zb.index(("SG", j)) + 1
            if s == S - 1 and M >= 2:
                assert zb.index(("B", M - 1)) < zb.index(("W", M - 2)) < zb.index(("W", M - 1))


@pytest.mark.parametrize("seed", range(6))
def test_zb_h1_is_never_slower_and_its_closed_form_stays_pessimistic(seed):
    """Random plans (1-5 stages, mixed types, uneven splits, 1-16 micro-batches): the zb-h1 replay is never
    longer than 1F1B's, splitting a backward only moves time (B + W = 1F1B's B), and the zb-h1 closed form is
    at most 0.5% under its replay. (It was an upper bound within 0.01%, and 12.5% above the replay on plans of few
    micro-batches: it charged the last stage a W it defers and no warm-up overlap on split stages. Priced as they
    run, these 48 plans replay at most 0.17% longer, and the MILP's ranked plans are within 5% on 96%.)

    (Never longer with the all-reduce in one bucket: in many, 1F1B hides it behind a whole last backward and
    zb-h1 only behind its last W, so there zb-h1 can lose a little; the closed form still bounds it.)"""
    from hethub.partitioner.evaluate import closed_form_s
    cm, one_bucket = CostModel(CLUSTER, MODEL), CostModel(CLUSTER, MODEL, bucket_mb=1e9)
    rng = random.Random(seed)
    for _ in range(8):
        plan = grid_plan(rng, rng.randint(1, 5), rng.choice([4, 8]), rng.choice([1, 2, 3, 8, 16]))
        assert simulate(_zb(plan), one_bucket).iteration_s <= simulate(plan, one_bucket).iteration_s * (1 + 1e-12)
        base, zb = simulate(plan, cm), simulate(_zb(plan), cm)
        assert zb.iteration_s - cm.control_syncs_s(plan) <= closed_form_s(_zb(plan), cm) * (1 + 5e-3)
        dur = lambda res, kind: sum(e.end_s - e.start_s for e in res.events if e.kind == kind)  # noqa: E731
        assert dur(zb, "W") > 0 or plan.num_stages == 1
        assert abs(dur(zb, "B") + dur(zb, "W") - dur(base, "B")) <= 1e-9 * dur(base, "B")


def test_zb_h1_speeds_up_a_deep_pipeline_and_holds_what_its_weight_passes_wait_with():
    """Six equal stages, 12 micro-batches: zb-h1's replay is shorter than 1F1B's by at least a stage's weight
    gradients per stage of drain. Memory: stage 0 (never split) holds 1F1B's; every later stage, from a B to
    its W, what the weight pass waits with in place of that micro-batch's forward activations; the last stage
    ends holding two of those (its last B runs before the W of the micro-batch before it)."""
    from hethub.partitioner.evaluate import stage_costs
    from hethub.partitioner.schedule import peak_in_flight
    cm = CostModel(CLUSTER, MODEL)
    bounds = [0, 3, 5, 7, 9, 10, MODEL.num_planner_layers]
    plan = build_plan(MODEL, CLUSTER, [StageLayout((bounds[s], bounds[s + 1]), "A100-80GB", (2, 2))
                                       for s in range(6)], 4, 12)
    base, zb = simulate(plan, cm).iteration_s, simulate(_zb(plan), cm).iteration_s
    wgrad = [c.weight_grad_s for c in stage_costs(_zb(plan), cm)]
    assert wgrad[0] == 0 and min(wgrad[1:]) > 0
    assert base - zb >= 0.5 * sum(wgrad[1:-1])
    assert [peak_in_flight("1f1b", 6, s, 12) for s in range(6)] == [6, 5, 4, 3, 2, 1]
    assert [peak_in_flight("zb-h1", 6, s, 12) for s in range(6)] == [6, 5, 4, 3, 2, 2]
    assert peak_in_flight("zb-h1", 6, 5, 1) == 1 and peak_in_flight("zb-h1", 1, 0, 12) == 1
    mem = lambda p: [c.memory_bytes for c in stage_costs(p, cm)]  # noqa: E731
    base_mem, zb_mem = mem(plan), mem(_zb(plan))
    act = [float(cm.act_bytes()[a:b].sum()) * 2 for a, b in zip(bounds, bounds[1:])]  # 2 rows per replica
    wait = [float(cm.wait_bytes()[a:b].sum()) * 2 for a, b in zip(bounds, bounds[1:])]
    assert all(w > a for w, a in zip(wait, act))  # the weight pass waits with the output gradients too
    assert zb_mem[0] == base_mem[0]
    for s in range(1, 5):
        assert zb_mem[s] - base_mem[s] == pytest.approx(wait[s] - act[s], rel=1e-9)
    assert zb_mem[5] - base_mem[5] == pytest.approx(2 * wait[5] - act[5], rel=1e-9)


def test_predicted_is_the_replay():
    """One objective: a plan's predicted iteration is its simulated iteration; the closed form rides along (here
    at most 0.1% optimistic, as ``test_closed_form_is_pessimistic_by_what_decoupled_stages_overlap`` bounds it)."""
    cm = CostModel(CLUSTER, MODEL)
    plan = grid_plan(random.Random(3), 3, 8, 6)
    pred = predict(plan, cm)
    assert pred.iteration_s == simulate(plan, cm).iteration_s
    assert pred.model_extra["closed_form_s"] >= pred.iteration_s * (1 - 1e-3)


def test_an_iteration_ends_with_the_control_all_reduce():
    """Every rank sums the loss over the world, in training in the same all-reduce as the gradient norm it clips
    by and fp16's vote on finite gradients: one latency-bound ring of 2 (n - 1) hops on the inter-node link
    where the plan spans hosts, on the intra-node one where it does not, in training and in evaluation."""
    net = {"intra_node_gbps": 2400, "inter_node_gbps": 100, "intra_node_latency_us": 7.0,
           "inter_node_latency_us": 900.0}
    cluster = CLUSTER.model_copy(update={"network": type(CLUSTER.network).model_validate(net)})
    cm = CostModel(cluster, MODEL)
    two_hosts = build_plan(MODEL, cluster, [StageLayout((0, 6), "A100-80GB", (2, 2)),
                                            StageLayout((6, 12), "V100-32GB", (1, 1, 1, 1))], 4, 3)
    one_host = build_plan(MODEL, cluster, [StageLayout((0, 6), "A100-80GB", (2, 2)),
                                           StageLayout((6, 12), "A100-80GB", (4,))], 4, 3)
    for plan, latency_s in ((two_hosts, 900e-6), (one_host, 7e-6)):
        for dtype, train, count in (("bf16", True, 1), ("fp16", True, 1), ("fp16", False, 1)):
            p = plan.model_copy(update={"dtype": dtype})
            res = simulate(p, cm, train=train)
            syncs = count * 2 * (p.world_size - 1) * latency_s
            assert cm.control_syncs_s(p, train) == pytest.approx(syncs, rel=1e-12)
            assert res.iteration_s == pytest.approx(max(e.end_s for e in res.events) + syncs, rel=1e-12)


def test_unmatched_send_and_deadlock_are_reported_with_rank_and_step():
    plan = grid_plan(random.Random(1), 2, 4, 3)
    cm = CostModel(CLUSTER, MODEL)
    sched = build_schedule(plan)
    first_rank_stage1 = plan.stages[1].replicas[0].rank
    bad = {r: list(a) for r, a in sched.items()}
    bad[first_rank_stage1] = [a for a in bad[first_rank_stage1] if not (a.kind == "RA" and a.mb == 1)]
    with pytest.raises(ScheduleError, match=r"rank \d+ step \d+: send of micro-batch 1 .* has no matching receive"):
        simulate(plan, cm, bad)
    with pytest.raises(ScheduleError, match=r"rank \d+ step \d+: F1 needs RA1 earlier"):
        simulate(plan, cm, bad_structure(sched, first_rank_stage1))
    with pytest.raises(ScheduleError, match=r"rank 0 step 4: deadlock: B0 waits for data from rank.*"
                                            r"F1 waits for data from rank\(s\) 0"):
        simulate(plan, cm, deadlocking(plan))


def test_misplaced_weight_passes_are_refused_with_rank_and_step():
    plan = _zb(grid_plan(random.Random(1), 2, 4, 3))
    cm = CostModel(CLUSTER, MODEL)
    sched = build_schedule(plan)
    r1, r0 = plan.stages[1].replicas[0].rank, plan.stages[0].replicas[0].rank
    early = {r: list(a) for r, a in sched.items()}
    w0 = next(a for a in early[r1] if a.kind == "W" and a.mb == 0)
    early[r1].remove(w0)
    early[r1].insert(0, w0)
    with pytest.raises(ScheduleError, match=rf"rank {r1} step 0: W0 needs B0 earlier"):
        simulate(plan, cm, early)
    late = {r: list(a) for r, a in sched.items()}
    late[r1].remove(w0)
    late[r1].append(w0)
    with pytest.raises(ScheduleError, match=rf"rank {r1} step \d+: W0 comes after AR"):
        simulate(plan, cm, late)
    first = {r: list(a) for r, a in sched.items()}
    first[r0].insert(first[r0].index(next(a for a in first[r0] if a.kind == "AR")), Action("W", 0))
    with pytest.raises(ScheduleError, match=rf"rank {r0}: stage 0 has no input gradients"):
        simulate(plan, cm, first)


def bad_structure(sched, rank):
    """A forward moved ahead of the receive that feeds it."""
    out = {r: list(a) for r, a in sched.items()}
    acts = out[rank]
    i_ra = next(i for i, a in enumerate(acts) if a.kind == "RA" and a.mb == 1)
    acts.insert(i_ra, acts.pop(next(i for i, a in enumerate(acts) if a.kind == "F" and a.mb == 1)))
    return out


def deadlocking(plan):
    """Well-formed but circular: stage 0 runs forward-backward without warm-up, stage 1 runs every forward
    before any backward (GPipe). Stage 1's F1 waits for stage 0's A1, sent only after stage 0's B0, which
    waits for G0 from stage 1's B0."""
    sched = build_schedule(plan)
    M = plan.num_micro_batches
    out = {}
    for s, st in enumerate(plan.stages):
        for rep in st.replicas:
            acts = {(a.kind, a.mb): a for a in sched[rep.rank]}
            if s == 0:
                keys = [k for j in range(M) for k in (("L", j), ("F", j), ("SA", j), ("RG", j), ("B", j))]
            else:
                keys = ([("RA", j) for j in range(M)] + [k for j in range(M) for k in (("L", j), ("F", j))]
                        + [k for j in range(M) for k in (("B", j), ("SG", j))])
            out[rep.rank] = [acts[k] for k in keys if k in acts] + [acts[("AR", None)], acts[("OPT", None)]]
    return out


def test_cli_simulate_writes_trace_and_png(tmp_path, example_plan_path):
    from conftest import run_cli
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    r = run_cli("simulate", example_plan_path, "--trace", str(trace), "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert "samples/s" in r.stdout and "bubble" in r.stdout
    assert re.search(r"^iteration [\d.]+ ms\b.*predicted [\d.]+ ms", r.stdout, re.M), r.stdout
    ev = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in ev if e["ph"] == "X"} == set(range(9))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_replay_hides_the_bucketed_allreduce_behind_the_last_backward():
    """One stage of four replicas on a slow network: with one bucket the all-reduce runs after the last
    backward; in many buckets all but about one bucket's share runs during it (as ``allreduce_end_s`` says)."""
    slow = Cluster.model_validate({"name": "slow", "nodes": [{"host": f"h{i}", "device_type": "A100-80GB",
                                                              "count": 1} for i in range(4)],
                                   "network": {"intra_node_gbps": 2400, "inter_node_gbps": 50}})
    plan = build_plan(MODEL, slow, [StageLayout((0, MODEL.num_planner_layers), "A100-80GB", even_split(8, 4))], 8, 2)
    single = CostModel(slow, MODEL, bucket_mb=1e6)
    one, (ar_one, n_one, _) = simulate(plan, single), single.stage_sync_parts(plan, 0)
    assert n_one == 1
    many = CostModel(slow, MODEL, bucket_mb=1.0)
    sim = simulate(plan, many)
    ar, n, rest = many.stage_sync_parts(plan, 0)
    _, bwd = many.stage_compute_s("A100-80GB", 0, MODEL.num_planner_layers, 2)
    assert n > 100 and ar > bwd  # more all-reduce than one backward can hide
    ars = [e for e in sim.events if e.kind == "allreduce"]
    assert ars and all(e.end_s - e.start_s == pytest.approx(ar - bwd * (n - 1) / n + rest, rel=1e-6) for e in ars)
    assert sim.iteration_s == pytest.approx(one.iteration_s - ar_one + ar - bwd * (n - 1) / n, rel=1e-6)
    assert predict(plan, many).iteration_s == pytest.approx(sim.iteration_s)


def test_a_wide_stage_prints_its_busy_range_and_a_replay_past_the_limit_is_refused(tmp_path, capsys, monkeypatch):
    """A 16-replica stage prints min/median/max busy (65,536 replicas printed 65,536 entries); a plan whose
    shortest faithful replay is past MAX_REPLAY_PAIRS is one line (a 1000-stage plan took 2.4 GiB) and its
    prediction is the closed form."""
    from hethub.cli.main import main
    from hethub.partitioner import evaluate
    plan = build_plan(MODEL, CLUSTER, [StageLayout((0, 6), "A100-80GB", (1,) * 16),
                                       StageLayout((6, 12), "V100-32GB", (2,) * 8)], 16, 4)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert main(["simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^stage 0 \(A100-80GB\): busy 16 replicas, min \d+%, median \d+%, max \d+%$", out, re.M), out
    assert re.search(r"^stage 1 \(V100-32GB\): busy r16 \d+%, .*r23 \d+%$", out, re.M), out
    assert plan.cluster.type_names is plan.cluster.type_names  # computed once, not per replica

    cm = CostModel(CLUSTER, MODEL)
    monkeypatch.setattr(evaluate, "MAX_REPLAY_PAIRS", plan.world_size * 4 - 1)
    assert not evaluate.replay_fits(plan)
    pred = predict(plan, cm)
    assert pred.iteration_s == pred.closed_form_s + cm.control_syncs_s(plan)  # the replay's, added as it does
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"error: plan: 2 stages on 24 ranks: a faithful replay runs at least 4 micro-batches "
                        r"\(96 rank-micro-batches\), past the 95 the simulator replays; the closed form predicts "
                        r"[\d.]+ ms", err), err


def test_a_plan_records_its_profiles_and_simulate_uses_them_or_says_why_not(tmp_path, capsys):
    """A plan made with --profiles was simulated on the analytic model (+5525% against its prediction)."""
    from conftest import EXAMPLES
    from hethub.cli.main import main
    from hethub.partitioner import builtin_model
    from hethub.partitioner.records import LayerProfile, Profile, load_plan
    m = builtin_model("gpt-tiny")
    prof_dir = tmp_path / "prof"
    prof_dir.mkdir()
    for t in ("A100-80GB", "V100-32GB"):  # 40 ms a layer: far from the analytic microseconds
        p = Profile(device_type=t, model=m, micro_batch_size=2, layers=[
            LayerProfile(index=li.index, kind=li.kind, forward_ms=40.0, backward_ms=80.0) for li in m.layers()])
        (prof_dir / f"{t}.json").write_text(p.to_json())
    out = tmp_path / "plans" / "plan.json"
    out.parent.mkdir()
    assert main(["plan", "--cluster", os.path.join(EXAMPLES, "cluster.yaml"), "--model", "gpt-tiny",
                 "--global-batch", "8", "--profiles", str(prof_dir), "--no-compare", "--time-limit", "5",
                 "-o", str(out)]) == 0
    plan = load_plan(str(out))
    assert [(r.path, r.device_type) for r in plan.profiles] == [
        (os.path.join("..", "prof", "A100-80GB.json"), "A100-80GB"), (os.path.join("..", "prof", "V100-32GB.json"),
                                                                       "V100-32GB")]
    capsys.readouterr()

    assert main(["simulate", str(out)]) == 0
    text = capsys.readouterr().out
    assert "profiles: 2 the plan records (bytes unchanged)" in text
    delta = float(re.search(r"predicted [\d.]+ ms, ([+-][\d.]+)%", text).group(1))
    assert abs(delta) < 5, text  # the replay of the plan's own cost model
    assert main(["show", str(out)]) == 0
    assert "priced with: profiles ../prof/A100-80GB.json (A100-80GB, sha256 " in capsys.readouterr().out

    (prof_dir / "V100-32GB.json").write_text((prof_dir / "V100-32GB.json").read_text().replace("40.0", "41.0"))
    assert main(["simulate", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^note: profiles\[1\]: .*V100-32GB.json changed since the plan was made", text, re.M), text
    assert "simulating with the analytic cost model" in text
    assert main(["simulate", str(out), "--profiles", str(prof_dir)]) == 0
    assert "1 of its profiles are not the ones the plan was made with" in capsys.readouterr().out


def test_the_closed_form_prices_a_host_nic_shared_by_several_stages():
    """Stages alternating between two hosts (X on one, Y on the other): each host's NIC carries the boundaries of
    two stages both ways, which no stage's own cost sees. The closed form paces the steady state by the busiest
    NIC direction and stays within 5% of the replay; without that term it was far under it."""
    from hethub.partitioner import Cluster, ModelConfig
    from hethub.partitioner.costmodel import CostModel
    from hethub.partitioner.evaluate import closed_form_s, iteration_s, nic_pace_s, predict, stage_costs
    from hethub.partitioner.placement import StageLayout, build_plan
    spec = {"vendor": "nvidia", "peak_tflops": 100, "memory_gib": 80, "memory_gbps": 2000}
    cluster = Cluster.model_validate({"device_types": {"X": spec, "Y": spec},
                                      "nodes": [{"host": "a", "device_type": "X", "count": 4},
                                                {"host": "b", "device_type": "Y", "count": 4}],
                                      "network": {"intra_node_gbps": 2400, "inter_node_gbps": 2}})
    model = ModelConfig(name="m", architecture="gpt", num_layers=6, hidden_size=1024, num_attention_heads=8,
                        ffn_hidden_size=4096, vocab_size=1024, seq_length=1024)
    plan = build_plan(model, cluster, [StageLayout((0, 2), "X", (1, 1)), StageLayout((2, 4), "Y", (1, 1)),
                                       StageLayout((4, 6), "X", (1, 1)), StageLayout((6, 8), "Y", (1, 1))], 2, 16)
    cm = CostModel(cluster, model)
    replay = predict(plan, cm).iteration_s
    without = iteration_s(stage_costs(plan, cm), plan.num_micro_batches)
    assert nic_pace_s(plan, cm) > max(c.pace_s for c in stage_costs(plan, cm))  # the shared NIC paces
    assert without < 0.9 * replay
    assert abs(closed_form_s(plan, cm) / replay - 1) < 0.05


def test_without_overlap_an_iteration_is_never_faster_and_explain_says_both():
    """The no-overlap network model (Sailor's simulator: transfers on the compute's path, the whole all-reduce
    after the last backward) prices every plan at least as slow as the overlapping closed form."""
    from hethub.partitioner.evaluate import closed_form_s, no_overlap_s
    from hethub.partitioner.explain import _replay_lines
    from instances import random_instance
    from hethub.partitioner.api import make_plan
    from hethub.partitioner.costmodel import CostModel
    from hethub.partitioner.errors import InfeasibleError
    from hethub.partitioner.planner import PlannerOptions
    checked = 0
    for seed in range(3):
        cluster, model, batch = random_instance(seed)
        cm = CostModel(cluster, model)
        try:
            plan = make_plan(cluster, model, batch, opts=PlannerOptions(time_limit_s=3), cost_model=cm,
                             with_homogeneous_sum=False)
        except InfeasibleError:  # an instance no plan fits is not this test's subject
            continue
        assert no_overlap_s(plan, cm) >= closed_form_s(plan, cm) * (1 - 1e-9)
        assert "without overlap" in _replay_lines(plan, cm)[0]
        checked += 1
    assert checked >= 2


def _v100_hosts(n_hosts: int, per_host: int = 4, inter_node_gbps: float = 12, intra_node_gbps: float = 10) -> Cluster:
    """V100 hosts, by default of 4 GPUs on a 12 Gbit/s network (the shape of Sailor's cases)."""
    return Cluster.model_validate({"nodes": [{"host": f"v{i}", "device_type": "V100-16GB", "count": per_host}
                                             for i in range(n_hosts)],
                                   "network": {"intra_node_gbps": intra_node_gbps, "inter_node_gbps": inter_node_gbps}})


def test_a_stage_fills_a_node_before_it_takes_the_next():
    """Placement puts a stage wider than a node on as few nodes as hold it. (It took one slot at a time from the
    emptiest node, so 8 replicas landed on 6 hosts: their NICs then carried two stages' boundaries each and the
    all-reduce crossed 6 hosts, which the planner's prices assume it does not.)"""
    model = ModelConfig(name="m", architecture="gpt", num_layers=4, hidden_size=256, num_attention_heads=4,
                        ffn_hidden_size=1024, vocab_size=1024, seq_length=128)
    plan = build_plan(model, _v100_hosts(6), [StageLayout((0, 3), "V100-16GB", (1,) * 8),
                                              StageLayout((3, 6), "V100-16GB", (1,) * 8)], 8, 4)
    assert [len({r.host for r in st.replicas}) for st in plan.stages] == [2, 2]


def test_the_closed_form_prices_the_queue_a_hosts_one_sample_replicas_form_on_its_nic(monkeypatch):
    """One-sample replicas, four to a host, on a 12 Gbit/s network: each stage's next pass waits for its
    neighbour's data (``evaluate.link_cycle_s``), and a host's four ranks queue on its NIC, where the queue, not
    the NIC's load nor the dependency cycle, sets the period (``evaluate.nic_cycle_s``). The ranks post in a
    staggered rhythm, so a transfer waits for half the queue mean-value analysis gives (``NIC_WAIT_SHARE``):
    the whole queue put this plan 13% above its replay."""
    from hethub.partitioner import costmodel
    from hethub.partitioner.evaluate import closed_form_s, link_cycle_s, nic_cycle_s, nic_pace_s
    from hethub.partitioner.evaluate import stage_costs
    model = ModelConfig(name="m", architecture="gpt", num_layers=12, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    cluster = _v100_hosts(6)
    cm = CostModel(cluster, model, dtype="fp16")
    plan = build_plan(model, cluster, [StageLayout((0, 5), "V100-16GB", (1,) * 8),
                                       StageLayout((5, 10), "V100-16GB", (1,) * 8),
                                       StageLayout((10, 14), "V100-16GB", (1,) * 8)], 8, 64, dtype="fp16")
    costs = stage_costs(plan, cm)
    replay = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)
    bare = max(nic_pace_s(plan, cm), link_cycle_s(costs))
    assert link_cycle_s(costs) > max(c.pace_s for c in costs) and nic_cycle_s(plan, cm, costs) > 1.05 * bare
    assert abs(closed_form_s(plan, cm) / replay - 1) < 0.05
    monkeypatch.setattr(costmodel, "NIC_WAIT_SHARE", 1.0)
    assert closed_form_s(plan, cm) / replay > 1.1


def test_a_saturated_nic_paces_at_its_load():
    """Four one-sample V100 replicas feed each 4-sample A100 of the last stage, on 12 Gbit/s: the A100 host's
    NIC carries 16 transfers a micro-batch each way, four per rank, more than its ranks' compute hides. Then its
    load is the period: a queue that waits for a share of mean-value analysis's must not pass a NIC faster than
    its load (unclamped, half the queue put this plan 13% below its replay)."""
    from hethub.partitioner.evaluate import closed_form_s, nic_cycle_s, nic_pace_s, stage_costs
    model = ModelConfig(name="m", architecture="gpt", num_layers=12, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    cluster = Cluster.model_validate({
        "nodes": [{"host": f"v{i}", "device_type": "V100-16GB", "count": 4} for i in range(8)]
        + [{"host": "a0", "device_type": "A100-40GB", "count": 4}],
        "network": {"intra_node_gbps": 2400, "inter_node_gbps": 12}})
    cm = CostModel(cluster, model, dtype="fp16")
    plan = build_plan(model, cluster, [StageLayout((0, 5), "V100-16GB", (1,) * 16),
                                       StageLayout((5, 10), "V100-16GB", (1,) * 16),
                                       StageLayout((10, 14), "A100-40GB", (4,) * 4)], 16, 32, dtype="fp16",
                      schedule="zb-h1")
    costs = stage_costs(plan, cm)
    assert nic_cycle_s(plan, cm, costs) == nic_pace_s(plan, cm) > max(c.pace_s for c in costs)
    replay = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)
    assert abs(closed_form_s(plan, cm) / replay - 1) < 0.03


def test_a_fan_out_boundary_pays_its_serialisation_once_per_round_trip():
    """One replica of 16 samples feeds 16 one-sample replicas on 25 Gbit/s: its 16 pieces leave in turn, and the
    pipeline's dependency cycle (``evaluate.link_cycle_s``) paces. In the steady state the receivers run staggered
    as their pieces landed, so their gradients come back in the order the activations left, and the sender's
    backward waits for the last: the round trip pays the serialisation once, plus one piece
    (``evaluate.boundary_latency_s``). The mean arrival each way, both posted at once, put this plan 3.9% above
    its replay."""
    from hethub.partitioner.evaluate import _boundary_arrivals, _boundary_legs, boundary_latency_s, closed_form_s
    from hethub.partitioner.evaluate import link_cycle_s, stage_costs
    model = ModelConfig(name="m", architecture="gpt", num_layers=12, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    cluster = _v100_hosts(6, per_host=8, inter_node_gbps=25, intra_node_gbps=2400)
    cm = CostModel(cluster, model, dtype="fp16")
    plan = build_plan(model, cluster, [StageLayout((0, 2), "V100-16GB", (16,)),
                                       StageLayout((2, 14), "V100-16GB", (1,) * 16)], 16, 8, dtype="fp16")
    costs = stage_costs(plan, cm)
    act, grad, piece_s = _boundary_arrivals(list(_boundary_legs(plan, cm, 0)), nics=False)
    assert len(act) == 16 and len(grad) == 1 and max(act.values()) == pytest.approx(16 * piece_s)
    assert boundary_latency_s(plan, cm, 0) == pytest.approx(17 * piece_s / 2)
    assert link_cycle_s(costs) > max(c.pace_s for c in costs)
    replay = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)
    assert abs(closed_form_s(plan, cm) / replay - 1) < 0.02


def test_a_lightly_loaded_nic_adds_little_queue():
    """Eight one-sample replicas to a host on 100 Gbit/s: posted at once, a host's transfers would queue on its
    NIC, but the receivers then start a transfer apart and stay so, and the NIC is busy about a third of the
    period: the queue adds under 2% to the dependency cycle. Charging the whole queue as the boundary's latency
    put this plan's closed form 7.1% above its replay (the 64 V100 + 64 A100 case's 1F1B plan: 6.1%)."""
    from hethub.partitioner.evaluate import closed_form_s, link_cycle_s, nic_cycle_s, nic_pace_s, stage_costs
    model = ModelConfig(name="m", architecture="gpt", num_layers=12, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    cluster = _v100_hosts(3, per_host=8, inter_node_gbps=100, intra_node_gbps=2400)
    cm = CostModel(cluster, model, dtype="fp16")
    plan = build_plan(model, cluster, [StageLayout((0, 6), "V100-16GB", (1,) * 8),
                                       StageLayout((6, 11), "V100-16GB", (1,) * 8),
                                       StageLayout((11, 14), "V100-16GB", (1,) * 8)], 8, 32, dtype="fp16")
    replay = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)
    costs = stage_costs(plan, cm)
    cycle = link_cycle_s(costs)
    assert cycle > max(max(c.pace_s for c in costs), 2.5 * nic_pace_s(plan, cm))  # the cycle paces, the NIC idles
    assert cycle < nic_cycle_s(plan, cm, costs) < 1.02 * cycle
    assert abs(closed_form_s(plan, cm) / replay - 1) < 0.04


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_stagger_the_nics_put_between_paired_replicas_is_paid_once_not_per_boundary(schedule):
    """Six stages of eight replicas, each stage on its own 8-GPU host, each replica sending to one of the next
    stage's: a host's NIC serialises its eight pieces once, and the receivers, started a piece apart, post their
    own next pieces a piece apart, so no later boundary queues them again (the compute paces, the NICs are
    two-thirds busy). The fill walked replica by replica is within 1% of the replay; the mean crossing charged
    at every boundary was 6.8-7.2% above it (seven 16-wide stages on 8-GPU hosts, noisy profiles: 5.2%)."""
    from hethub.partitioner.evaluate import (closed_form_s, iteration_s, nic_cycle_s, nic_pace_s, stage_costs,
                                             walked_trip_s)
    model = ModelConfig(name="m", architecture="gpt", num_layers=24, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    cluster = _v100_hosts(6, per_host=8, inter_node_gbps=40, intra_node_gbps=2400)
    cm = CostModel(cluster, model, dtype="fp16")
    cuts = [0, 4, 9, 13, 17, 22, 26]
    plan = build_plan(model, cluster, [StageLayout((a, b), "V100-16GB", (2,) * 8) for a, b in zip(cuts, cuts[1:])],
                      16, 12, dtype="fp16", schedule=schedule)
    costs = stage_costs(plan, cm)
    assert nic_pace_s(plan, cm) < 0.7 * max(c.pace_s for c in costs)  # the compute paces
    replay = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)
    assert abs(closed_form_s(plan, cm) / replay - 1) < 0.01
    per_boundary = iteration_s(costs, plan.num_micro_batches, nic_cycle_s(plan, cm, costs))
    assert per_boundary / replay > 1.05
    # a boundary that fans out re-forms the stagger: the walk does not hold there
    fan = build_plan(model, cluster, [StageLayout((0, 13), "V100-16GB", (4,) * 4),
                                      StageLayout((13, 26), "V100-16GB", (2,) * 8)], 16, 12, dtype="fp16")
    assert walked_trip_s(fan, cm, stage_costs(fan, cm)) is None


def test_the_1f1b_drain_below_a_stage_counts_its_crossings_and_its_slowest_backwards():
    """Under 1F1B a stage's all-reduce is charged from its own last backward: stage 0's less the drain below it.
    The last micro-batch's gradient crosses every boundary of that drain, and the slowest replica below ends
    last. Three stages of eight (V100 | A100 | V100) on 25 Gbit/s, two micro-batches: the last stage's
    all-reduce ends the iteration, and with the backwards alone the closed form was 5.7% above the replay (the
    Metis-shaped plans of the 80 A100 + 240 V100 case: 6%). Two replicas of 7 and 1 samples before eight of one:
    with the shortest replica's backward as the drain (a bound), 21% above it."""
    from hethub.partitioner.evaluate import closed_form_s, stage_costs
    model = ModelConfig(name="m", architecture="gpt", num_layers=24, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    cluster = Cluster.model_validate({
        "nodes": [{"host": f"{t[0].lower()}{i}", "device_type": t, "count": 4}
                  for t in ("V100-16GB", "A100-40GB") for i in range(4)],
        "network": {"intra_node_gbps": 2400, "inter_node_gbps": 25}})
    cm = CostModel(cluster, model, dtype="fp16")
    plan = build_plan(model, cluster, [StageLayout((0, 6), "V100-16GB", (2,) * 8),
                                       StageLayout((6, 16), "A100-40GB", (2,) * 8),
                                       StageLayout((16, 26), "V100-16GB", (2,) * 8)], 16, 2, dtype="fp16")
    costs = stage_costs(plan, cm)
    assert costs[-1].allreduce_s > sum(c.compute_s for c in costs)  # the last stage's all-reduce ends it
    replay = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)
    assert 1.0 <= closed_form_s(plan, cm) / replay < 1.05
    model = model.model_copy(update={"seq_length": 1024})
    cluster = cluster.model_copy(update={"network": cluster.network.model_copy(update={"inter_node_gbps": 100})})
    cm = CostModel(cluster, model, dtype="fp16")
    plan = build_plan(model, cluster, [StageLayout((0, 22), "A100-40GB", (7, 1)),
                                       StageLayout((22, 26), "A100-40GB", (1,) * 8)], 8, 2, dtype="fp16")
    replay = simulate(plan, cm).iteration_s - cm.control_syncs_s(plan)
    assert abs(closed_form_s(plan, cm) / replay - 1) < 0.03


def test_a_plan_planned_without_overlap_is_never_slower_so_and_says_both(tmp_path, capsys, monkeypatch):
    """``--network no-overlap``: the MILP's candidates and the choice among plans price the network as Sailor's
    simulator does, so the written plan is at least as fast under that model as the plan planned for overlap
    (both proven optimal here); the plan records the model and ``plan`` prints both figures."""
    from hethub.cli.main import main
    from hethub.partitioner.api import make_plan
    from hethub.partitioner.evaluate import no_overlap_s
    from hethub.partitioner.planner import PlannerOptions
    from instances import random_instance
    cluster, model, batch = random_instance(0)
    cm = CostModel(cluster, model)
    plans = {net: make_plan(cluster, model, batch, opts=PlannerOptions(time_limit_s=5, network=net), cost_model=cm,
                            with_homogeneous_sum=False) for net in ("overlap", "no-overlap")}
    assert all(p.solver.status == "optimal" for p in plans.values())
    assert no_overlap_s(plans["no-overlap"], cm) < no_overlap_s(plans["overlap"], cm)  # 0.234 vs 0.242 s
    assert plans["no-overlap"].solver.network == "no-overlap"
    assert plans["no-overlap"].predicted.iteration_s == predict(plans["no-overlap"], cm).iteration_s  # the replay
    (tmp_path / "c.json").write_text(cluster.model_dump_json())
    (tmp_path / "m.json").write_text(model.model_dump_json())
    assert main(["plan", "--cluster", str(tmp_path / "c.json"), "--model", str(tmp_path / "m.json"), "--global-batch",
                 str(batch), "--time-limit", "5", "--no-compare", "--network", "no-overlap", "--dtype", cm.dtype,
                 "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"network: planned without overlap .*: [\d,.]+ samples/s so; [\d,.]+ as the runtime overlaps them",
                     out), out
    assert main(["show", str(tmp_path / "p.json")]) == 0
    assert "planned without overlap (--network no-overlap)" in capsys.readouterr().out
    with pytest.raises(Exception, match=r"PlannerOptions.network: expected one of overlap, no-overlap"):
        PlannerOptions(network="sailor")
    # auto's schedule among the chosen groups' variants: the fastest without overlap, not the fastest replay
    from hethub.partitioner.evaluate import fits_memory
    from hethub.partitioner.schedule_search import choose_schedule, variants
    from hethub.partitioner import schedule_search
    real = schedule_search.predict

    def interleaved_replays_fastest(q, *a, **kw):  # as on a 128-device case: fastest replayed, slowest without overlap
        pred = real(q, *a, **kw)
        return pred.model_copy(update={"iteration_s": pred.iteration_s / 10}) if q.num_chunks > 1 else pred
    monkeypatch.setattr(schedule_search, "predict", interleaved_replays_fastest)
    base = plans["no-overlap"]
    fitting = [q for q in variants(base, cm, "auto") if fits_memory(q, cm)]
    assert len(fitting) >= 3
    assert choose_schedule(base, cm, "auto")[0].num_chunks > 1
    best, _ = choose_schedule(base, cm, "auto", overlap=False)
    assert no_overlap_s(best, cm) == pytest.approx(min(no_overlap_s(q, cm) for q in fitting), rel=1e-12)
    assert best.num_chunks == 1
    # 1F1B and zb-h1 cost the same without overlap: the tie goes to the faster replay (it went to the first listed,
    # 1F1B, whose replay on Sailor-shaped case 1 was 1.1% slower)
    tied = [q for q in fitting if no_overlap_s(q, cm) == no_overlap_s(best, cm)]
    assert len(tied) >= 2
    assert best.predicted.iteration_s == min(schedule_search.predict(q, cm).iteration_s for q in tied)


def test_the_closed_form_of_every_plan_the_milp_ranks_stays_near_its_replay():
    """Every micro-batch size's best chain the MILP offers (what ``choose_by_simulation`` ranks), placed, on random
    instances: the closed form is never optimistic by more than 2.5% and every one is within 5% of the replay (on
    16 instances, 105 plans: at most 2.1% optimistic, 3.4% pessimistic; 75% within 5% before the warm-up credit).
    The 2.1% is seed 6's second zb-h1 chain, whose host NIC carries one stage's gradients and the next stage's
    activations: booked in posting order (the replay's), the gradients go first and the activations wait (booked
    rank by rank, as the replay did before, 0.1% optimistic), and its fill charges mean crossings (M >= S; with
    the slowest, 1.4%). The replay decides among them. The solves run to optimality (a generous time limit), so
    the set of plans does not depend on the machine's load: a 2 s limit on a loaded CI machine once stopped seed
    6's 1F1B solve at a feasible chain of 3 micro-batches the form prices 17% high. Under 1F1B a stage's all-reduce is charged from
    its own last backward's bound (stage 0's less the shortest backwards below it): charged from stage 0's, the 1F1B
    plans here reached 10.8% pessimistic, 89% within 5% (now 5.6%, 96%; a stage running all its forwards before
    its first backward, M <= S - b - 1, had none of the warm-up credit: 8.9% on seed 9). zb-h1's form charged its last stage a W it
    defers and no warm-up overlap on split stages: its plans here reached 6.8% pessimistic, 91% within 5% (now 3.2%,
    all; on 16 instances 12.5% and 73% became 6.1% and 96%)."""
    from hethub.partitioner.errors import InfeasibleError
    from hethub.partitioner.evaluate import closed_form_s
    from hethub.partitioner.planner import PlannerOptions, search, solution_layouts, units_for
    from instances import random_instance
    ratios, one_f_one_b, zb = [], [], []
    for seed in range(16):
        cluster, model, batch = random_instance(seed)
        cm = CostModel(cluster, model)
        for schedule in ("1f1b", "zb-h1"):
            try:
                _, stats = search(cm, batch, PlannerOptions(time_limit_s=120, schedule=schedule))
            except InfeasibleError:
                continue
            assert stats["status"] == "optimal", (seed, schedule, stats["status"])
            for alt in stats["alternatives"]:
                plan = build_plan(model, cluster, solution_layouts(alt, units_for(model, None), cluster.type_names),
                                  alt.b, alt.M, schedule=schedule)
                ratios.append((closed_form_s(plan, cm) + cm.control_syncs_s(plan)) / simulate(plan, cm).iteration_s)
                (one_f_one_b if schedule == "1f1b" else zb).append(ratios[-1])
    assert len(ratios) >= 40
    assert min(ratios) >= 0.975 and max(ratios) <= 1.15, (min(ratios), max(ratios))
    assert sum(abs(r - 1) <= 0.05 for r in ratios) >= 0.75 * len(ratios)
    for kind in (one_f_one_b, zb):
        assert max(kind) <= 1.08 and sum(abs(r - 1) <= 0.05 for r in kind) >= 0.9 * len(kind), sorted(kind)
    # every plan within 5% (seed 1's 4 stages of 2 micro-batches, two equal stages' link cycle just above their
    # compute, were credited no warm-up overlap: 5.6% pessimistic; seeds 13 and 14's zb-h1 plans of 3 micro-batches
    # were charged a last return period with a W the last stage defers: 6.0% and 6.1%)
    assert max(ratios) <= 1.05, sorted(ratios)


def test_a_ranked_plan_whose_replay_runs_past_the_deadline_is_not_chosen(monkeypatch):
    """``choose_by_simulation`` replays its best closed forms in turn; each after the first runs with the deadline,
    and one that passes it (``OutOfTime``) ends the replays: the plan is chosen among those replayed."""
    import time

    from hethub.partitioner import evaluate
    from hethub.partitioner.simulator import OutOfTime
    cm = CostModel(CLUSTER, MODEL)
    plans = [grid_plan(random.Random(3), 3, 8, 6), grid_plan(random.Random(3), 3, 8, 6)]
    real, calls = evaluate.predict, []

    def second_runs_long(p, cm_, *args, deadline=None):
        calls.append(deadline)
        if len(calls) > 1:
            raise OutOfTime("ran past its deadline")
        return real(p, cm_, *args, deadline=deadline)
    monkeypatch.setattr(evaluate, "predict", second_runs_long)
    chosen = evaluate.choose_by_simulation(plans, cm, deadline=time.perf_counter() + 600)
    assert calls[0] is None and calls[1] is not None
    assert chosen.predicted.model_extra["replayed"] == 1 and chosen.predicted.iteration_s > 0
