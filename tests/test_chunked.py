"""Tier 1: chunked schedules (interleaved-1f1b, zb-v) as plan data, action lists, replays and plans.

A device group of a chunked plan holds several contiguous layer ranges; the schedules are data (``F3@5`` prints and
parses back), every one the product writes passes the structure checks, the event replay and NCCL's ordering for
every width pattern and M = 1..8, and the planner keeps the fastest variant that fits memory.
"""
import json

import pytest

from hethub.partitioner.chunked import chunk_orders, interleaved_orders, rechunk, zbv_orders
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.errors import InputError
from hethub.partitioner.evaluate import (chunk_time_s, group_memory_bytes, predict, with_micro_batches,
                                         with_pass_times)
from hethub.partitioner.ordering import check_order
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.records import Cluster, Plan, builtin_model
from hethub.partitioner.schedule import Action, build_schedule
from hethub.partitioner.schedule_search import choose_schedule, explain_schedules
from hethub.partitioner.simulator import ScheduleError, simulate
from cli_util import cli_error, write
from instances import CASES, CPU_CLUSTER, STACK, stack_plan

DEEP = stack_plan([2, 4], [[4], [2, 2], [1, 3]], 4, 3)  # three groups: 2, 2 and 3 of the 7 layers


def test_chunk_actions_print_and_parse_back():
    for text in ("F3@5", "B0@2", "W7@1", "SA3@4>r5[0:2]>r6[2:4]", "RG1@0<r2[0:4]", "L3", "F3", "AR"):
        assert str(Action.parse(text)) == text
    assert Action.parse("F3@5").chunk == 5 and Action.parse("F3").chunk is None
    for bad in ("L3@1", "AR@2", "F3@"):
        with pytest.raises(ValueError):
            Action.parse(bad)


def _chunked(plan: Plan, schedule: str, chunks) -> dict:
    data = json.loads(plan.to_json())
    data["schedule"] = schedule
    for st, c in zip(data["stages"], chunks):
        st.pop("layers")
        st["chunks"] = c
    return data


def test_a_chunked_plan_round_trips_and_lists_its_chunks_in_pipeline_order():
    plan = rechunk(DEEP, "interleaved-1f1b", 2)
    assert [st.chunk_ranges for st in plan.stages] == [((0, 1), (4, 5)), ((1, 2), (5, 6)), ((2, 4), (6, 7))]
    assert [c.group for c in plan.pipeline] == [0, 1, 2, 0, 1, 2]
    assert Plan.from_json(plan.to_json()) == plan
    one = json.loads(DEEP.to_json())  # one chunk written as "chunks" reads as "layers"
    one["stages"][0]["chunks"] = [one["stages"][0].pop("layers")]
    assert Plan.model_validate(one).stages[0].layers == (0, 2)
    assert [c.group for c in rechunk(DEEP, "zb-v", 2).pipeline] == [0, 1, 2, 2, 1, 0]


GOOD = [[[0, 1], [3, 4]], [[1, 2], [4, 5]], [[2, 3], [5, 7]]]  # interleaved: chunk k on group k mod 3


@pytest.mark.parametrize("schedule, group, chunks, message", [
    ("zb-v", 2, [[2, 3], [5, 6], [6, 7]], r"stages\[2\]\.chunks: schedule 'zb-v' gives every group 2 chunks, got 3"),
    ("interleaved-1f1b", 2, [[2, 3], [5, 5]], r"stages\[2\]\.chunks\[1\]: must hold at least one layer, got \[5, 5\)"),
    ("interleaved-1f1b", 2, [[2, 3], [5, 9]], r"stages\[2\]\.chunks\[1\]: model 'stack' has 7 planner layers"),
    ("interleaved-1f1b", 2, [[2, 3], [5, 6], [6, 7]],
     r"stages\[2\]\.chunks: every group holds the same number of chunks \(2, as stages\[0\]\), got 3"),
    ("interleaved-1f1b", 0, [[0, 2], [3, 4]], r"chunk 1 must start at 2, got \[1, 2\) \(overlap\)"),
    ("interleaved-1f1b", 2, [[2, 3], [6, 7]], r"stages\[2\]\.chunks\[1\]: .*chunk 5 must start at 5, got \[6, 7\) \(gap\)"),
    ("interleaved-1f1b", 2, [[2, 3], [5, 6]], r"stages: chunks must cover all 7 planner layers, they end at 6"),
    ("1f1b", 0, [[0, 1], [3, 4]], r"stages\[0\]\.chunks: schedule '1f1b' runs one chunk per group"),
    ("interleaved-1f1b", 1, [], r"stages\[1\]\.chunks: tuple should have at least 1 item"),  # v = 0
    ("zb-v", 0, [[0, 1], [3, 4]],  # an interleaved layout under zb-v
     r"stages\[0\]\.chunks\[1\]: schedule 'zb-v' places chunk 3 \(layers \[3, 4\)\) on group 2, not 0"),
])
def test_bad_chunk_layouts_are_one_line_naming_the_field(schedule, group, chunks, message):
    layout = [list(c) for c in GOOD]
    layout[group] = chunks
    with pytest.raises(InputError, match=message):
        Plan.from_json(json.dumps(_chunked(DEEP, schedule, layout)), "plan")


def test_a_chunk_on_the_wrong_group_and_layers_beside_chunks_are_named(tmp_path, capsys):
    swapped = [[[0, 1], [4, 5]], [[1, 2], [3, 4]], [[2, 3], [5, 7]]]
    with pytest.raises(InputError, match=r"stages\[1\]\.chunks\[1\]: schedule 'interleaved-1f1b' places chunk 3 "
                                         r"\(layers \[3, 4\)\) on group 0, not 1"):
        Plan.from_json(json.dumps(_chunked(DEEP, "interleaved-1f1b", swapped)), "plan")
    both = _chunked(DEEP, "interleaved-1f1b", GOOD)
    both["stages"][0]["layers"] = [0, 1]
    err = cli_error(capsys, ["show", write(tmp_path, "both.json", json.dumps(both))])
    assert "a group lists its layers or its chunks, not both" in err and len(err.strip().splitlines()) == 1


def test_the_launcher_places_a_chunked_plans_ranks_like_any_other(tmp_path, capsys):
    """A chunked plan launches (the runtime runs it: tests/test_chunked_runtime.py); its dry run lists each rank."""
    from hethub.cli.main import main
    plan = rechunk(DEEP, "zb-v", 2)
    path, script = write(tmp_path, "plan.json", plan.to_json()), write(tmp_path, "train.py", "")
    assert main(["launch", "--hetero-plan", path, "--dry-run", script]) == 0
    out = capsys.readouterr().out
    assert f"--include localhost:{','.join(map(str, range(plan.world_size)))} " in out and "--hetero-plan" in out


SHAPES = {name: stack_plan(*case) for name, case in CASES.items()}
SHAPES["3groups"] = DEEP


@pytest.mark.parametrize("schedule, v", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-v", 2)])
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_chunked_schedule_passes_structure_replay_and_nccl_order(name, schedule, v):
    """A given schedule goes through every check (matching, structure, event replay, NCCL's order) for
    M = 1..8: M not a multiple of the group count included (the generalised rounds of interleaving)."""
    base = SHAPES[name]
    if min(st.layer_count() for st in base.stages) < v:
        pytest.skip("a group has fewer layers than chunks")
    cm = CostModel(CPU_CLUSTER, STACK)
    for m in range(1, 9):
        plan = with_micro_batches(rechunk(base, schedule, v), m)
        for train in (True, False):
            sched = build_schedule(plan, train=train)
            assert simulate(plan, cm, sched, train=train).iteration_s > 0


def test_a_chunked_schedule_with_a_forward_of_a_chunk_the_rank_does_not_hold_is_refused():
    plan = rechunk(DEEP, "interleaved-1f1b", 2)
    sched = build_schedule(plan)
    r0 = plan.stages[0].replicas[0].rank
    bad = {r: list(a) for r, a in sched.items()}
    k = next(i for i, a in enumerate(bad[r0]) if a.kind == "F")
    bad[r0][k] = Action("F", bad[r0][k].mb, (), 1)
    with pytest.raises(ScheduleError, match=rf"rank {r0} step {k}: F0@1: rank {r0} holds chunks 0, 3"):
        simulate(plan, CostModel(CPU_CLUSTER, STACK), bad)


def _finishes(orders, V) -> bool:
    """Each group runs its order in turn; a pass runs once what it needs has run (forward after the previous chunk's,
    backward after its forward and the next chunk's backward, W after its B)."""
    done, pcs, moved = set(), [0] * len(orders), True
    while moved:
        moved = False
        for g, order in enumerate(orders):
            while pcs[g] < len(order):
                kind, mb, k = order[pcs[g]]
                need = ([("F", mb, k - 1)] if k else []) if kind == "F" else [("B", mb, k)] if kind == "W" else (
                    [("F", mb, k)] + ([("B", mb, k + 1)] if k < V - 1 else []))
                if not all(n in done for n in need):
                    break
                done.add((kind, mb, k))
                pcs[g] += 1
                moved = True
    return all(pc == len(o) for pc, o in zip(pcs, orders))


def test_interleaving_and_zbv_finish_for_every_group_count_chunk_count_and_micro_batch_count():
    """Megatron's static alternation deadlocks once p does not divide M (p=4, v=3, M=5 among 156 cases up to
    p=7, v=4, M=39); the generalised orders finish in all of them, each pass once; zb-v's also when ordered by
    random pass times."""
    import random
    rng = random.Random(0)
    for p in range(1, 7):
        for M in range(1, 20):
            for v in range(1, 5):
                orders = interleaved_orders(p, v, M)
                assert _finishes(orders, p * v), (p, v, M)
                for g, order in enumerate(orders):
                    assert sorted(order) == sorted((kd, mb, c * p + g) for kd in "FB" for c in range(v)
                                                   for mb in range(M))
            assert _finishes(zbv_orders([1 + k % 3 for k in range(2 * p)], p, M), 2 * p), (p, M)
            timed = [tuple(rng.uniform(0.1, 5.0) for _ in range(3)) for _ in range(2 * p)]
            assert _finishes(zbv_orders([1] * (2 * p), p, M, pass_ms=timed), 2 * p), (p, M, timed)
    assert interleaved_orders(3, 1, 5)[0] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("F", 3, 0), ("B", 1, 0), ("F", 4, 0), ("B", 2, 0),
        ("B", 3, 0), ("B", 4, 0)]  # v = 1: 1F1B


def test_zbv_holds_at_most_one_f1b_first_stage_of_activations_on_its_first_leg():
    for p, M in ((2, 8), (4, 8), (3, 5)):
        for g, order in enumerate(zbv_orders([1] * (2 * p), p, M)):
            held = peak = 0
            for kind, mb, k in order:
                if k >= p:
                    continue
                held += kind == "F"
                held -= kind == "W" or (kind == "B" and k == 0)
                peak = max(peak, held)
            assert peak <= 2 * p
            assert sum(kind == "W" for kind, _, k in order) == M * (2 - (g == 0))  # chunk 0 has no W


V100_A100 = Cluster.model_validate({"name": "a100-v100", "nodes": [
    {"host": "v0", "device_type": "V100-32GB", "count": 8}, {"host": "a0", "device_type": "A100-80GB", "count": 8}],
    "network": {"intra_node_gbps": 2400, "inter_node_gbps": 200}})


def test_zbv_orders_its_passes_by_their_times_where_groups_run_at_different_speeds():
    """8 V100 then 8 A100 (fp16), gpt-1.3b cut where the MILP cuts it: the V100 group's chunks hold 3 and 4 layers,
    the A100 group's 10 and 9. Ordered by layer counts, the A100s waited for V100 passes the order took for short
    (1.90 s/iteration); by the passes' times, 1.58 s. The times travel in the plan, so every consumer (runtime,
    simulator, deadlock check) derives the same order from it."""
    model, cm = builtin_model("gpt-1.3b"), CostModel(V100_A100, builtin_model("gpt-1.3b"), dtype="fp16")
    plan = build_plan(model, V100_A100, [StageLayout((0, 8), "V100-32GB", (1,) * 8),
                                         StageLayout((8, model.num_planner_layers), "A100-80GB", (1,) * 8)], 8, 16,
                      dtype="fp16")
    by_count = rechunk(plan, "zb-v", 2, chunk_time_s(plan, cm))
    by_time = with_pass_times(by_count, cm)
    assert by_count.chunk_pass_ms is None and len(by_time.chunk_pass_ms) == 4
    assert predict(by_time, cm).iteration_s < 0.9 * predict(by_count, cm).iteration_s
    again = Plan.from_json(by_time.to_json())
    assert again == by_time and chunk_orders(again, 16) == chunk_orders(by_time, 16) != chunk_orders(by_count, 16)
    for m in (1, 3, 16):
        q = with_micro_batches(by_time, m)
        for train in (True, False):
            check_order(q, build_schedule(q, train=train))
    assert rechunk(by_time, "zb-v", 2).chunk_pass_ms is None  # new chunks, new times: the old ones are dropped
    assert with_pass_times(plan, cm) is plan  # one chunk per group: nothing to order by time


@pytest.mark.parametrize("schedule, times, message", [
    ("zb-v", [[1, 1, 1]] * 5, r"chunk_pass_ms: one \[forward, input gradient, weight gradient\] per chunk \(6\), "
                              r"got 5"),
    ("zb-v", [[1, -1, 1]] * 6, r"chunk_pass_ms\[0\]\[1\]: must be >= 0, got -1"),
    ("zb-v", [[0, 0, 0]] * 6, r"chunk_pass_ms\[0\]: a chunk's passes take time, got \[0.0, 0.0, 0.0\]"),
    ("interleaved-1f1b", [[1, 1, 1]] * 6, r"chunk_pass_ms: only zb-v orders its passes by time"),
])
def test_bad_pass_times_are_one_line_naming_the_field(schedule, times, message):
    data = json.loads(rechunk(DEEP, schedule, 2).to_json())
    data["chunk_pass_ms"] = times
    with pytest.raises(InputError, match=message):
        Plan.from_json(json.dumps(data), "plan")


BALANCED = stack_plan([2, 4], [[4], [4], [4]], 4, 8)  # three groups of one width, M = 8


A100 = Cluster.model_validate({"name": "a100", "device_types": {"A100-80GB": {
    "vendor": "nvidia", "peak_tflops": {"bf16": 312}, "memory_gib": 80, "memory_gbps": 2000}},
    "nodes": [{"host": "n", "device_type": "A100-80GB", "count": 8}]})


@pytest.mark.parametrize("micro_batches", [4, 16])
def test_more_chunks_shrink_the_fill_of_a_balanced_pipeline(micro_batches):
    """gpt-1.3b on four groups of two A100s: the same groups cut by time into one chunk each (1F1B) and into
    three (interleaved) or a V (zb-v): the chunked schedules must predict less (the fill shrinks). Cut by count
    (the MILP's layers per group kept exactly) then polished, interleaving predicts 0.75x at M = 4, 0.90x at 16."""
    model = builtin_model("gpt-1.3b")
    cuts = [0, 7, 14, 21, model.num_planner_layers]
    plan = build_plan(model, A100, [StageLayout((cuts[i], cuts[i + 1]), "A100-80GB", (2,)) for i in range(4)], 2,
                      micro_batches)
    cm = CostModel(A100, model)
    price = chunk_time_s(plan, cm)
    t1 = predict(rechunk(plan, "interleaved-1f1b", 1, price), cm).iteration_s
    assert t1 == pytest.approx(predict(plan, cm).iteration_s, rel=0.02)  # v = 1 by time: about the plan's balance
    assert predict(rechunk(plan, "interleaved-1f1b", 3, price), cm).iteration_s < 0.97 * t1
    # zb-v's list-scheduled order gains less once the fill is a small share (M = 16: 0.976x)
    assert predict(rechunk(plan, "zb-v", 2, price), cm).iteration_s < (0.97 if micro_batches == 4 else 1.0) * t1


def _activation_peak(plan, cm, group):
    st = plan.stages[group]
    state = sum(cm.state_bytes(a, b) for a, b in st.chunk_ranges)
    buffers = sum(2.0 * float(cm.layers.out_bytes[max(a - 1, 0)]) * 4 for a, _ in st.chunk_ranges)
    return group_memory_bytes(plan, cm, group, 4) - state - buffers


def test_chunked_memory_follows_each_schedule_in_flight_activations():
    """Interleaving's longer warm-up holds more of group 0's activations than 1F1B (p micro-batches of its
    layers); zb-v caps its first leg at 1F1B's first-stage memory."""
    cm = CostModel(CPU_CLUSTER, STACK)
    plain = rechunk(BALANCED, "interleaved-1f1b", 1)
    one = float(cm.act_bytes()[slice(*plain.stages[0].layers)].sum()) * 4
    assert _activation_peak(plain, cm, 0) == pytest.approx(3 * one)  # 1F1B: group 0 holds p = 3
    il = rechunk(BALANCED, "interleaved-1f1b", 2)
    assert _activation_peak(il, cm, 0) > 3 * one
    assert predict(il, cm).memory_gib[0] > predict(plain, cm).memory_gib[0]


def test_between_its_b_and_its_w_a_chunk_holds_what_the_weight_pass_waits_with():
    """Under a split backward a chunk-micro-batch holds, from its B to its W, the graph kept for the weights plus
    the output gradients the W needs (``CostModel.wait_bytes``), more than its forward left: with the runtime's
    meter counting those too, pricing that span as the forward's bytes understated zb-v's peaks by up to 34%
    (benchmarks/chunked.py)."""
    from hethub.partitioner.evaluate import activation_peak_bytes
    cm = CostModel(CPU_CLUSTER, STACK)
    for chunk in (BALANCED.pipeline[-1], BALANCED.pipeline[0]):  # with the head (the logits' gradient), without
        k, rows = chunk.position, 4
        whole = float(cm.act_bytes()[chunk.first:chunk.last].sum()) * rows
        wait = float(cm.wait_bytes()[chunk.first:chunk.last].sum()) * rows
        assert wait > whole
        split = [("F", 0, k), ("B", 0, k), ("F", 1, k), ("W", 0, k), ("B", 1, k), ("W", 1, k)]
        fused = [("F", 0, k), ("B", 0, k), ("F", 1, k), ("B", 1, k)]
        assert activation_peak_bytes(BALANCED, cm, chunk.group, rows, split) == pytest.approx(wait + whole)
        assert activation_peak_bytes(BALANCED, cm, chunk.group, rows, fused) == pytest.approx(whole)


def test_auto_keeps_the_fastest_variant_that_fits_and_reports_each():
    cm = CostModel(CPU_CLUSTER, STACK)
    plan = BALANCED.model_copy(update={"predicted": predict(BALANCED, cm)})
    best, tried = choose_schedule(plan, cm, "auto")
    names = {(s, v) for s, v, _, _ in tried}
    assert {("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2)} <= names
    assert best.predicted.iteration_s == min(it for _, _, it, fits in tried if fits)
    assert (best.schedule, best.num_chunks) == min(((s, v, it) for s, v, it, fits in tried if fits),
                                                   key=lambda x: x[2])[:2]


def test_auto_is_the_default_and_plans_its_groups_for_zb_h1_falling_back_to_1f1b(monkeypatch):
    """``hethub plan`` without --schedule means auto; auto's MILP plans for zb-h1 (its groups fit 1F1B too, which
    is replayed beside it), then, with time left, 1F1B's groups too (the faster replay wins); where zb-h1's memory
    leaves no plan, for 1F1B only."""
    from hethub.cli.parser import build_parser
    from hethub.partitioner import api
    from hethub.partitioner.errors import InfeasibleError
    from hethub.partitioner.planner import PlannerOptions
    args = build_parser().parse_args(["plan", "--cluster", "c.yaml", "--model", "m", "--global-batch", "8"])
    assert args.schedule == "auto"
    searched = []
    real = api.search

    def search(cm, batch, opts, progress=None):
        searched.append(opts.schedule)
        limits.append(opts.time_limit_s)
        if opts.schedule == "zb-h1" and refuse:
            raise InfeasibleError("memory", "no plan fits (a test)")
        return real(cm, batch, opts, progress)
    monkeypatch.setattr(api, "search", search)
    cm = CostModel(CPU_CLUSTER, STACK)
    for refuse, expect in ((False, ["zb-h1", "1f1b"]), (True, ["zb-h1", "1f1b"])):
        searched.clear()
        limits = []
        plan = api.solve(cm, 8, PlannerOptions(time_limit_s=5, schedule="auto"))
        assert searched == expect
        # 1F1B's search gets what zb-h1's left, less twice what its replays took (it was given half of it)
        assert refuse or limits[1] > 0.6 * 5, limits
        assert {t["schedule"] for t in plan.solver.schedules} >= {"1f1b", "zb-h1"}
    with pytest.raises(InfeasibleError):  # a schedule asked for by name does not fall back
        api.solve(cm, 8, PlannerOptions(time_limit_s=5, schedule="zb-h1"))


def test_auto_leaves_chunks_out_of_a_one_stage_plan_and_prints_short_iterations():
    """One group has no pipeline to fill: cutting it into chunks only hands activations to itself, so auto tries
    1f1b and zb-h1 only; a tiny model's iteration (10 us) prints in significant digits, not as 0.0 ms, and a long
    one as 55,140 ms, not 5.514e+04 ms."""
    from hethub.partitioner.schedule_search import variants
    cm = CostModel(CPU_CLUSTER, STACK)
    one = stack_plan([], [[4]], 4, 3)
    assert [q.schedule for q in variants(one, cm, "auto")] == ["1f1b", "zb-h1"]
    assert {q.schedule for q in variants(BALANCED, cm, "auto")} >= {"interleaved-1f1b", "zb-v"}
    chosen = one.model_copy(update={"predicted": predict(one, cm)})
    line = explain_schedules([("1f1b", 1, 1.02e-5, True)], chosen)[0]
    assert "0.0102 ms/iteration" in line
    long = chosen.model_copy(update={"predicted": chosen.predicted.model_copy(update={"iteration_s": 55.14})})
    assert "  55,140 ms/iteration (1.000x)" in explain_schedules([("1f1b", 1, 55.14, True)], long)[0]


def test_auto_replays_no_variant_that_cannot_be_chosen(monkeypatch):
    """Where some variant fits memory, the ones that do not are listed unreplayed (None): at 768 devices their
    replays were most of ``auto``'s time. ``replay_all`` replays them; none fitting, every one is replayed and the
    fastest kept, marked as not fitting."""
    from hethub.partitioner import schedule_search
    cm = CostModel(CPU_CLUSTER, STACK)
    plan = BALANCED.model_copy(update={"predicted": predict(BALANCED, cm)})
    replayed = []
    monkeypatch.setattr(schedule_search, "predict", lambda q, *a, **kw: replayed.append(q.schedule) or predict(q, *a, **kw))
    monkeypatch.setattr(schedule_search, "fits_memory", lambda q, cm: q.schedule != "zb-v")
    best, tried = choose_schedule(plan, cm, "auto")
    assert [(it, fits) for s, _, it, fits in tried if s == "zb-v"] == [(None, False)] and "zb-v" not in replayed
    assert all(it is not None for s, _, it, _ in tried if s != "zb-v") and best.schedule != "zb-v"
    assert any("zb-v" in line and "not replayed" in line for line in explain_schedules(tried, best))
    replayed.clear()
    _, tried = choose_schedule(plan, cm, "auto", replay_all=True)
    assert "zb-v" in replayed and all(it is not None for _, _, it, _ in tried)
    monkeypatch.setattr(schedule_search, "fits_memory", lambda q, cm: False)
    best, tried = choose_schedule(plan, cm, "auto")
    assert best.predicted.iteration_s == min(it for _, _, it, _ in tried)


def test_rechunk_by_time_is_no_slower_in_its_slowest_chunk_than_by_count():
    """zb-v puts the last chunk (with the head) on group 0: cut by layer count, group 0 gets the head on top of its
    share; cut by time, the slowest chunk is no slower than by count."""
    cm = CostModel(CPU_CLUSTER, STACK)
    price = chunk_time_s(BALANCED, cm)
    by_count, by_time = rechunk(BALANCED, "zb-v", 2), rechunk(BALANCED, "zb-v", 2, price)
    worst = lambda q: max(price(c.group, c.first, c.last) for c in q.pipeline)  # noqa: E731
    assert worst(by_time) <= worst(by_count) + 1e-12


def test_zbv_cuts_give_the_busiest_group_the_least_work_any_cut_can():
    """``chunked.v_sizes`` against brute force over every cut on random small instances: groups price layers
    differently (a group's type, width and share), and a cheap layer for one group is dear for the next. The
    same instances showed that keeping only the farthest right edge per left edge misses the optimum."""
    import itertools
    import random

    from hethub.partitioner.chunked import _score, v_sizes
    from hethub.partitioner.records import chunk_group
    rng = random.Random(7)
    for _ in range(150):
        p = rng.randint(1, 3)
        n = rng.randint(2 * p, 2 * p + 5)
        cost = [[rng.choice([1, 2, 3, 5, 8]) * rng.uniform(0.5, 1.5) for _ in range(n)] for _ in range(p)]
        chunk_s = lambda g, a, b: sum(cost[g][a:b])  # noqa: E731
        owner = [chunk_group("zb-v", p, k) for k in range(2 * p)]
        best = min(_score([b - a for a, b in zip((0, *cuts), (*cuts, n))], owner, p, chunk_s)[0]
                   for cuts in itertools.combinations(range(1, n), 2 * p - 1))
        sizes = v_sizes(p, n, chunk_s)
        assert len(sizes) == 2 * p and min(sizes) >= 1 and sum(sizes) == n
        assert _score(sizes, owner, p, chunk_s)[0] == pytest.approx(best, rel=1e-5)


def test_rechunk_takes_the_exact_v_where_polishing_the_count_cut_stalls(monkeypatch):
    """FAST / SLOW / FAST / SLOW groups (SLOW at half speed) and uneven layers: cut by count and polished one layer
    at a time, the busiest group does 8 units; the exact V (``v_sizes``) does 7, the least any cut can. Past its
    table's budget the count cut stays."""
    from instances import two_host_cluster

    from hethub.partitioner import chunked
    from hethub.partitioner.chunked import _polish, _score, balanced_sizes, count_sizes
    from hethub.partitioner.records import ModelConfig
    model = ModelConfig(name="m", architecture="gpt", num_layers=10, hidden_size=64, num_attention_heads=4,
                        ffn_hidden_size=256, vocab_size=512, seq_length=16)
    plan = build_plan(model, two_host_cluster("f", "s"), [
        StageLayout((0, 4), "FAST", (2,)), StageLayout((4, 6), "SLOW", (2,)), StageLayout((6, 10), "FAST", (2,)),
        StageLayout((10, 12), "SLOW", (2,))], 2, 4)
    layer, speed = [1, 3, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2], [1.0, 2.0, 1.0, 2.0]
    chunk_s = lambda g, a, b: speed[g] * sum(layer[a:b])  # noqa: E731
    busiest = lambda q: max(sum(chunk_s(g, c.first, c.last) for c in q.pipeline if c.group == g)  # noqa: E731
                            for g in range(4))
    owner = [c.group for c in rechunk(plan, "zb-v", 2).pipeline]
    polished = _polish(count_sizes(plan, "zb-v", 2), owner, 4, chunk_s)
    assert _score(polished, owner, 4, chunk_s)[0] == 8.0
    assert balanced_sizes(plan, "zb-v", 2, chunk_s) != polished
    assert busiest(rechunk(plan, "zb-v", 2, chunk_s)) == 7.0
    monkeypatch.setattr(chunked, "EXACT_V_CELLS", 4 * 13 ** 2 - 1)  # past the table's budget: by count, polished
    assert busiest(rechunk(plan, "zb-v", 2, chunk_s)) == 8.0


def test_auto_skips_chunk_counts_a_group_cannot_hold():
    """DEEP's first group has two layers: interleaving with v = 3 or 4 cannot cut it, and auto leaves those out
    (a ValueError from the 768-device benchmark's 3-layer group at v = 4)."""
    cm = CostModel(CPU_CLUSTER, STACK)
    plan = DEEP.model_copy(update={"predicted": predict(DEEP, cm)})
    _, tried = choose_schedule(plan, cm, "auto")
    assert {v for s, v, _, _ in tried if s == "interleaved-1f1b"} == {2}


@pytest.mark.parametrize("schedule, v", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-v", 2)])
def test_a_shortened_replay_of_a_chunked_plan_extrapolates_to_its_full_replay(monkeypatch, schedule, v):
    """Past ``SIM_BUDGET`` a prediction replays two shorter iterations and extrapolates linearly. For a chunked
    plan both must be past its warm-up (about two micro-batches per chunk of the pipeline) and, interleaved, leave
    M's remainder mod p: 4 groups of gpt-1.3b at M = 64 then predict the full replay within 0.5%. (Replayed from
    2S + 2 and S + 1 micro-batches, as for 1F1B, the 768-device benchmark's chunked plans came out 5.6-10%
    faster than their full replays, and were reported so.)"""
    from hethub.partitioner import evaluate
    model = builtin_model("gpt-1.3b")
    cuts = [0, 7, 14, 21, model.num_planner_layers]
    plan = build_plan(model, A100, [StageLayout((cuts[i], cuts[i + 1]), "A100-80GB", (2,)) for i in range(4)], 2,
                      64)
    cm = CostModel(A100, model)
    chunked = with_pass_times(rechunk(plan, schedule, v, chunk_time_s(plan, cm)), cm)
    full = simulate(chunked, cm).iteration_s
    monkeypatch.setattr(evaluate, "SIM_BUDGET", 1)  # every prediction extrapolates
    assert evaluate.replay_micro_batches(chunked) < chunked.num_micro_batches
    assert predict(chunked, cm).iteration_s == pytest.approx(full, rel=0.005)


def test_auto_leaves_out_chunked_variants_too_long_to_replay(monkeypatch):
    """Past ``MAX_REPLAY_PAIRS`` a prediction is the closed form, which only ranks chunked plans: ``auto`` then
    keeps to the one-chunk schedules (a chunked replay needs 4D + 2 micro-batches, 1F1B's 2S + 2)."""
    from hethub.partitioner import evaluate
    cm = CostModel(CPU_CLUSTER, STACK)
    plan = with_micro_batches(BALANCED, 40)
    plan = plan.model_copy(update={"predicted": predict(plan, cm)})
    monkeypatch.setattr(evaluate, "SIM_BUDGET", 1)
    monkeypatch.setattr(evaluate, "MAX_REPLAY_PAIRS", plan.world_size * (2 * plan.num_stages + 2))
    best, tried = choose_schedule(plan, cm, "auto")
    assert {s for s, _, _, _ in tried} == {"1f1b", "zb-h1"} and best.num_chunks == 1
    best, tried = choose_schedule(plan, cm, "zb-v")  # asked for by name: priced by the closed form
    assert [(s, v) for s, v, _, _ in tried] == [("zb-v", 2)]


def test_auto_keeps_the_faster_replay_of_groups_planned_for_zb_h1_and_for_1f1b(monkeypatch):
    """Where 1F1B's groups replay faster than zb-h1's under every schedule (the closed form cannot see why: NIC
    queues), auto writes them; with no time left after zb-h1's search it does not search again."""
    from hethub.partitioner import api
    from hethub.partitioner.planner import PlannerOptions
    cm = CostModel(CPU_CLUSTER, STACK)
    real = api.choose_by_simulation

    def slower_zb(plans, cm_, **kw):  # zb-h1's groups replay 3x slower than they do
        plan = real(plans, cm_, **kw)
        if plan.schedule == "zb-h1":
            plan = plan.model_copy(update={"predicted": plan.predicted.model_copy(
                update={"iteration_s": 3 * plan.predicted.iteration_s})})
        return plan
    monkeypatch.setattr(api, "choose_by_simulation", slower_zb)
    monkeypatch.setattr(api, "choose_schedule", lambda plan, cm_, wanted, **kw: (plan, []))
    plan = api.solve(cm, 8, PlannerOptions(time_limit_s=5, schedule="auto"))
    assert plan.schedule == "1f1b"
    monkeypatch.setattr(api, "AUTO_SECOND_SHARE", 1.01)  # never time left
    assert api.solve(cm, 8, PlannerOptions(time_limit_s=5, schedule="auto")).schedule == "zb-h1"


def test_auto_reuses_the_plans_own_replay_and_replays_no_variant_past_its_deadline(monkeypatch):
    """The plan's own variant keeps the replay it carries (on 768 devices in 49 stages a replay took 3.2 s and was
    made twice); past the deadline no other variant is replayed, and each says why it has no figure."""
    import time as time_
    from hethub.partitioner import schedule_search
    cm = CostModel(CPU_CLUSTER, STACK)
    plan = BALANCED.model_copy(update={"predicted": predict(BALANCED, cm)})
    replayed = []
    real = schedule_search.predict

    def counting(q, cm_, *args, **kw):
        replayed.append((q.schedule, q.num_chunks))
        return real(q, cm_, *args, **kw)
    monkeypatch.setattr(schedule_search, "predict", counting)
    best, tried = choose_schedule(plan, cm, "auto")
    assert (plan.schedule, plan.num_chunks) not in replayed and len(replayed) == len(tried) - 1, (replayed, tried)
    replayed.clear()
    best, tried = choose_schedule(plan, cm, "auto", deadline=time_.perf_counter())
    assert replayed == [] and best.predicted == plan.predicted and (best.schedule, best.num_chunks) == (
        plan.schedule, plan.num_chunks)
    lines = explain_schedules(tried, best)
    assert sum("not replayed (the time limit was spent)" in line for line in lines) == len(tried) - 1 - sum(
        not fits for *_, fits in tried), lines


def test_a_variant_whose_replay_runs_past_the_deadline_is_dropped(monkeypatch):
    """A replay may take twice another's, so the estimate before it can be wrong: each replay after the first runs
    with the deadline, and one that passes it (``simulator.OutOfTime``) is dropped like a variant never replayed
    (768 devices, `plan --schedule 1f1b --time-limit 10`: the second replay took 0.98 s after a first of 0.51 s and
    ended the search at 10.05 s)."""
    import time as time_
    from hethub.partitioner import schedule_search
    from hethub.partitioner.simulator import OutOfTime, simulate
    cm = CostModel(CPU_CLUSTER, STACK)
    with pytest.raises(OutOfTime, match="ran past its deadline"):
        simulate(BALANCED, cm, deadline=time_.perf_counter() - 1)
    real = schedule_search.predict
    deadlines = []

    def slow_chunked(q, cm_, *args, deadline=None):
        deadlines.append(deadline)
        if q.num_chunks > 1 and deadline is not None:  # every chunked variant's replay runs too long
            raise OutOfTime("ran past its deadline")
        return real(q, cm_, *args, deadline=deadline)
    monkeypatch.setattr(schedule_search, "predict", slow_chunked)
    best, tried = choose_schedule(BALANCED, cm, "auto", deadline=time_.perf_counter() + 600)
    assert deadlines[0] is None and all(d is not None for d in deadlines[1:])  # the first replay is always made
    dropped = [t for t in tried if t[1] > 1]
    assert dropped and all(it is None for _, _, it, _ in dropped), tried
    assert best.num_chunks == 1 and best.predicted is not None
    assert sum(it is not None for _, v, it, _ in tried if v == 1) >= 2, tried
