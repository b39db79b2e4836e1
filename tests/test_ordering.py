"""Tier 1: every schedule hethub can write finishes under NCCL's ordering, and the replay catches those that do not.

NCCL runs a group's operations in issue order on each rank and a receive completes only when its send runs; gloo
matches by tag and hides violations. ``partitioner.ordering`` replays action lists under NCCL's rule with the
runtime's own groups (one per boundary and direction, ``partitioner.groups``).
"""
import pytest

from hethub.partitioner import Cluster, ModelConfig, Plan
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.evaluate import with_micro_batches
from hethub.partitioner.ordering import OrderError, check_order, one_group_per_boundary
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.chunked import rechunk
from hethub.partitioner.records import CHUNKED, SCHEDULES
from hethub.partitioner.schedule import Action, build_schedule
from hethub.partitioner.simulator import simulate
from instances import CASES, stack_plan

TP_CLUSTER = Cluster.model_validate({
    "name": "cpu-tp",
    "device_types": {"CPU": {"vendor": "cpu", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20}},
    "nodes": [{"host": "a", "device_type": "CPU", "count": 8}, {"host": "b", "device_type": "CPU", "count": 8}]})
WIDE = ModelConfig(name="wide", architecture="gpt", num_layers=6, hidden_size=16, num_attention_heads=2,
                   ffn_hidden_size=32, vocab_size=8, seq_length=1)


def _shapes():
    """Every width pattern of the runtime tests, a four-stage plan, and a tensor-parallel stage in the middle."""
    out = {name: stack_plan(*case) for name, case in CASES.items()}
    out["4stages"] = stack_plan([1, 3, 5], [[4], [2, 2], [1, 3], [4]], 4, 3)
    out["4stages-2"] = stack_plan([2, 4, 6], [[4], [2, 2], [1, 3], [4]], 4, 3)  # two layers each: chunks of one
    out["tp-middle"] = build_plan(WIDE, TP_CLUSTER, [StageLayout((0, 2), "CPU", (2, 2)),
                                                     StageLayout((2, 5), "CPU", (4,), tensor_parallel=2),
                                                     StageLayout((5, 8), "CPU", (1, 1, 2))], 4, 3)
    return out


SHAPES = _shapes()


def with_schedule(plan, schedule, v=2):
    """The plan under ``schedule``: its groups cut into v chunks (two under zb-v) where the schedule is chunked
    (fewer where a group has fewer layers, under interleaved-1f1b; zb-v skips such a plan)."""
    if schedule not in CHUNKED:
        return plan.model_copy(update={"schedule": schedule})
    fewest = min(st.layer_count() for st in plan.stages)
    if schedule == "zb-v" and fewest < 2:
        pytest.skip("a group of one layer cannot hold zb-v's two chunks")
    return rechunk(plan, schedule, min(v, fewest))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_written_schedule_finishes_under_nccl_ordering(name, schedule):
    base = with_schedule(SHAPES[name], schedule)
    for m in range(1, 9):
        plan = with_micro_batches(base, m)
        for train in (True, False):
            for tensors in (1, 2):  # an action may carry several tensors: per tensor, per peer, on both sides
                check_order(plan, build_schedule(plan, train=train), n_tensors=tensors)


@pytest.mark.parametrize("name", ["1to1", "2to3", "1to2to1", "4stages"])
def test_both_directions_on_one_group_deadlock_from_two_micro_batches(name):
    """The layout the runtime had (one group for a boundary's sends and receives): the replay must find the
    cycle the GPU would hang in (stage s's recv G0 behind stage s+1's recv A1, and back)."""
    plan = with_micro_batches(SHAPES[name], 1)
    check_order(plan, build_schedule(plan), group_of=one_group_per_boundary)
    plan = with_micro_batches(SHAPES[name], 2)
    with pytest.raises(OrderError, match=r"deadlocks under NCCL's ordering .* rank \d+ is stuck at "):
        check_order(plan, build_schedule(plan), group_of=one_group_per_boundary)


def _swap_receives(plan):
    """The last stage's receives of micro-batches 0 and 1 posted in the other order: fine by tag, wrong by order."""
    sched = build_schedule(plan)
    r = plan.stages[-1].replicas[0].rank
    acts = sched[r]
    i, j = next(k for k, a in enumerate(acts) if a.kind == "RA" and a.mb == 0), \
        next(k for k, a in enumerate(acts) if a.kind == "RA" and a.mb == 1)
    acts[i], acts[j] = acts[j], acts[i]
    return sched, r


def test_receives_posted_out_of_order_are_refused_naming_both_ranks():
    plan = with_micro_batches(SHAPES["1to1"], 3)
    sched, r = _swap_receives(plan)
    with pytest.raises(OrderError, match=rf"rank 0 at SA0>r{r}\[0:4\] and rank {r} at RA1<r0\[0:4\] pair different "
                                         r"messages \(metadata of A0 vs metadata of A1\) on the fwd group of the boundary after stage 0"):
        check_order(plan, sched)


def test_hethub_simulate_refuses_a_schedule_only_nccl_deadlocks_on():
    """Matched by key (as gloo matches by tag) the swapped receives would pass; the simulator checks NCCL's
    order first and refuses the schedule naming both ranks and the mis-paired messages."""
    plan = with_micro_batches(SHAPES["1to1"], 3)
    sched, _r = _swap_receives(plan)
    cm = CostModel(plan.cluster, plan.model)
    with pytest.raises(OrderError, match="pair different messages"):
        simulate(plan, cm, sched)
    assert simulate(plan, cm, build_schedule(plan)).iteration_s > 0


def test_a_cycle_through_compute_is_named_with_rank_and_action():
    """Stage 0 runs B0 before F1 (it needs G0 first) while stage 1 runs both forwards before any backward (its
    B0, which sends G0, needs A1, which stage 0 sends only after B0): the replay names who is stuck where."""
    plan = with_micro_batches(SHAPES["1to1"], 2)
    sched = build_schedule(plan)
    order = [a for a in sched[0] if a.kind not in ("AR", "OPT")]
    first = [a for a in order if a.mb == 0]
    second = [a for a in order if a.mb == 1]
    sched[0] = first + second + [Action("AR"), Action("OPT")]
    r1 = sched[1]
    sched[1] = ([a for a in r1 if a.kind == "RA"] + [a for a in r1 if a.kind in ("L", "F")] +
                [a for a in r1 if a.kind in ("B", "SG")] + [Action("AR"), Action("OPT")])
    with pytest.raises(OrderError, match=r"rank 0 is stuck at B0"):
        check_order(plan, sched)



def test_deep_pipelines_and_many_micro_batches_finish_under_the_send_window():
    """Random pipelines of 1-12 groups (widths 1 and 2, unequal layer counts), every schedule, M from 1 to 40,
    training and evaluation: each finishes under NCCL's order with at most ``SEND_WINDOW`` unfinished sends per
    peer, zb-v's also when ordered by random pass times (zb-v's order once ran a chunk's forwards further ahead of their consumer than that and hung with
    4 groups and 8 micro-batches, 15 groups and 39)."""
    import random
    cluster = Cluster.model_validate({
        "name": "cpu-64", "device_types": TP_CLUSTER.model_dump()["device_types"],
        "nodes": [{"host": "h", "device_type": "CPU", "count": 64}]})
    model = ModelConfig(name="deep", architecture="gpt", num_layers=62, hidden_size=12, num_attention_heads=1,
                        ffn_hidden_size=12, vocab_size=6, seq_length=1)
    rng, layers, checked = random.Random(1), model.num_planner_layers, 0
    for p in range(1, 13):
        for _ in range(3):
            bounds = [0, *sorted(rng.sample(range(4, layers - 3), p - 1)), layers]
            if any(b - a < 4 for a, b in zip(bounds, bounds[1:])):
                continue  # zb-v and interleaved (v <= 4) need layers to cut
            widths = [rng.choice([1, 1, 2]) for _ in range(p)]
            base = build_plan(model, cluster, [StageLayout((bounds[i], bounds[i + 1]), "CPU",
                                                           (4 // w,) * w) for i, w in enumerate(widths)], 4, 4)
            for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4),
                                ("zb-v", 2), ("zb-v", "timed")):
                plan = rechunk(base, schedule, 2 if v == "timed" else v) if schedule in CHUNKED else base.model_copy(
                    update={"schedule": schedule})
                if v == "timed":  # ordered by random pass times (``Plan.chunk_pass_ms``)
                    plan = Plan.model_validate({**plan.model_dump(), "chunk_pass_ms": [
                        tuple(rng.uniform(0.1, 5.0) for _ in range(3)) for _ in plan.pipeline]})
                for m in sorted({1, 2, 3, 8, p + 1, 2 * p + 3, 3 * p, rng.randint(1, 40)}):
                    q = with_micro_batches(plan, m)
                    for train in (True, False):
                        check_order(q, build_schedule(q, train=train))
                        checked += 1
    assert checked > 500
