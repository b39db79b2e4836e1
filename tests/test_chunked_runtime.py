"""Tier 2 (multi-process gloo): chunked schedules (interleaved-1f1b, zb-v) run and train exactly like one process.

Each device group holds several chunks (uneven ones: the groups' layer counts do not divide by v), the groups have
unequal widths and uneven sample splits, and M is not a multiple of the group count. In float64 the losses, the
evaluation loss and every layer's final weights equal one process's to rounding; every rank ran exactly its action
list (``F3@5``...). Every multi-process test runs over the strict-order gloo transport, so a transfer order that
would hang on NCCL hangs here too.
"""
import os

import pytest
import torch

from conftest import ROOT
from dist_util import run_python, spawn
from hethub.partitioner.chunked import chunk_orders, rechunk
from hethub.partitioner import Plan
from hethub.partitioner.groups import group_specs
from hethub.partitioner.schedule import build_schedule
from plans import run_and_compare, stack_plan

pytestmark = pytest.mark.dist

pytest.importorskip("deepspeed")

THREE = stack_plan([2, 4], [[4], [2, 2], [1, 3]], 4, 4)  # widths 1, 2, 2 over 2, 2 and 3 layers; M = 4, p = 3
TWO = stack_plan([3], [[4], [1, 3]], 4, 5)  # widths 1, 2 over 3 and 4 layers; M = 5, p = 2
F64 = 1e-12


def bridged(plan: Plan) -> Plan:
    """Every boundary between two groups through the host bridge (its own gloo groups, host buffers), as between
    vendors: the bridge carries chunk-to-chunk traffic too, from the last group back to the first included."""
    cross = [k for k in range(len(plan.pipeline) - 1) if plan.pipeline[k].group != plan.pipeline[k + 1].group]
    return Plan.model_validate({**plan.model_dump(), "boundaries": [{"after_stage": k, "transport": "host"}
                                                                    for k in cross]})


def timed(plan: Plan, pass_ms) -> Plan:
    """The zb-v plan ordered by ``pass_ms`` (``Plan.chunk_pass_ms``), asserted to change the order."""
    out = Plan.model_validate({**plan.model_dump(), "chunk_pass_ms": pass_ms})
    assert chunk_orders(out, out.num_micro_batches) != chunk_orders(plan, plan.num_micro_batches)
    return out


@pytest.mark.parametrize("base, schedule, v, bridge", [(THREE, "interleaved-1f1b", 2, False),
                                                       (TWO, "interleaved-1f1b", 3, True),
                                                       (THREE, "zb-v", 2, False)])
def test_every_chunked_schedule_trains_like_one_process_in_float64(tmp_path, base, schedule, v, bridge):
    """zb-v ordered by its passes' times, group 0 three times slower than the others (the unit-cost order runs in
    the tests below)."""
    plan = rechunk(base, schedule, v)
    if schedule == "zb-v":
        plan = timed(plan, [(3.0, 3.0, 3.0) if c.group == 0 else (1.0, 1.0, 1.0) for c in plan.pipeline])
    if bridge:
        plan = bridged(plan)
        assert {s.stage for s in group_specs(plan) if s.purpose == "fwd" and s.on_host} == set(range(5))
    sizes = {c.last - c.first for c in plan.pipeline}
    assert len(sizes) > 1 and plan.num_micro_batches % plan.num_stages  # uneven chunks, M not a multiple of p
    run_and_compare(tmp_path, plan, rtol=F64, atol=F64, extra=["f64"])


def test_zbv_hands_its_turn_to_itself_and_splits_every_backward_but_the_first_chunks(tmp_path):
    """zb-v's last group holds chunks p-1 and p: each replica passes its rows to itself (no process group is made
    for that boundary, no operation posted), and runs W passes (weight gradients) apart from B (input gradients)."""
    plan = rechunk(THREE, "zb-v", 2)
    turn = plan.num_stages - 1
    assert not [s for s in group_specs(plan) if s.purpose in ("fwd", "bwd") and s.stage == turn]
    sched = build_schedule(plan)
    for rep in plan.stages[-1].replicas:
        sa = [a for a in sched[rep.rank] if a.kind == "SA" and a.chunk == turn]
        assert sa and all(t.peer == rep.rank for a in sa for t in a.transfers)
    assert all(any(a.kind == "W" for a in acts) for acts in sched.values())


@pytest.mark.parametrize("schedule, tie", [("zb-v", "1,5"), ("interleaved-1f1b", "1,4")])
def test_a_weight_tied_across_chunks_trains_like_one_process(tmp_path, schedule, tie):
    """Layers 1 and 5 on one group's two chunks (zb-v: its gradient accumulates from both chunks' passes, and
    buckets wait for the later one); layers 1 and 4 on two groups (interleaved: a tie group between them)."""
    plan = rechunk(THREE, schedule, 2)
    i, j = (int(x) for x in tie.split(","))
    layer_group = {layer: c.group for c in plan.pipeline for layer in range(c.first, c.last)}
    assert (layer_group[i] == layer_group[j]) == (schedule == "zb-v")
    run_and_compare(tmp_path, plan, rtol=F64, atol=F64, extra=["f64", f"tie={tie}"])


RESUME = os.path.join("tests", "workers", "resume.py")


def test_checkpoints_move_between_chunked_and_unchunked_plans_with_identical_weights(tmp_path):
    """zb-v for K steps, saved; 1F1B on other widths for K, saved; interleaved for K: the same losses and weights
    as one process running 3K steps (checkpoint layer files are per layer, whatever the chunking)."""
    k, ckpt = 2, str(tmp_path / "ckpt")
    base = stack_plan([3], [[3, 3], [2, 2, 2]], 6, 2)
    legs = [rechunk(base, "zb-v", 2), stack_plan([2, 5], [[6], [4, 2], [6]], 6, 2), rechunk(base, "interleaved-1f1b", 3)]
    for n, plan in enumerate(legs):
        path = str(tmp_path / f"plan{n}.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        load = ["--load", ckpt] if n else []
        for rank, (rc, _o, err) in enumerate(spawn(plan.world_size, [
                RESUME, path, str(tmp_path / f"leg{n}-{{rank}}.pt"), str(n * k), str((n + 1) * k), "adam", "0.05",
                "--save", ckpt, *load])):
            assert rc == 0, f"leg {n} rank {rank}:\n{err[-3000:]}"
    r = run_python([RESUME, "single", str(tmp_path / "ref.pt"), "0", str(3 * k), "adam", "0.05"], timeout=60)
    assert r.returncode == 0, r.stderr
    ref = torch.load(str(tmp_path / "ref.pt"), weights_only=True)
    seen = set()
    for n, plan in enumerate(legs):
        for rank in range(plan.world_size):
            got = torch.load(str(tmp_path / f"leg{n}-{rank}.pt"), weights_only=True)
            # float32 Adam: the plans sum gradients in another order than one process (tests/test_checkpoint.py)
            torch.testing.assert_close(got["losses"], ref["losses"][n * k:(n + 1) * k], rtol=1e-5, atol=0)
            if n == len(legs) - 1:
                for name, value in got["params"].items():
                    torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-5)
                    seen.add(name)
    assert seen == set(ref["params"])


PIN_SCALE = 10.0
TIMES = ("forward_ms", "backward_ms", "input_grad_ms", "weight_grad_ms")


def test_a_run_holds_the_activations_its_schedule_order_predicts(tmp_path):
    """What autograd holds at its peak on every rank of a 3-stage zb-h1 run (the activation meter, counting what a
    split backward's weight pass waits with) against ``evaluate.activation_peak_bytes`` on profiled bytes: within
    5%. Counting in-flight micro-batches of forward activations, as the memory model did before, falls short by
    more than 15% on every split stage (its B holds the weight pass's inputs and output gradients until its W).

    The same run is pinned (``HETHUB_EMULATE_PROFILES``) to profiles 10x slower than the measured ones: every
    forward, input pass and weight pass lasts at least its pinned time (``hethub.emulated.pinned``), which the real
    compute alone (a tenth of it) would not."""
    import json
    from hethub.cli.demo import DEMO_CLUSTER, DEMO_MODEL
    from hethub.cli.profiler import profile_model
    from hethub.partitioner import Cluster, ModelConfig
    from hethub.partitioner.costmodel import CostModel, pass_times_s
    from hethub.partitioner.evaluate import activation_peak_bytes
    from hethub.partitioner.records import Profile
    from hethub.partitioner.placement import StageLayout, build_plan
    cluster, model = Cluster.model_validate(DEMO_CLUSTER), ModelConfig.model_validate(DEMO_MODEL)
    n = model.num_planner_layers
    profiles = [profile_model(model, "SLOW", mb, "fp32", warmup=1, reps=1, progress=False) for mb in (1, 2)]
    cm = CostModel(cluster, model, dtype="fp32", profiles=profiles, memory_reserve_gib=0.5)
    plan = build_plan(model, cluster, [StageLayout(r, "SLOW", (2,)) for r in ((0, 3), (3, 6), (6, n))], 2, 4)
    plan = plan.model_copy(update={"schedule": "zb-h1"})
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "model.json").write_text(model.to_json())
    mem = tmp_path / "held"
    pins = tmp_path / "pins"
    pins.mkdir()
    for p in profiles:
        slower = [lp.model_copy(update={k: getattr(lp, k) * PIN_SCALE for k in TIMES if getattr(lp, k)})
                  for lp in p.layers]
        (pins / f"SLOW-{p.micro_batch_size}.json").write_text(p.model_copy(update={"layers": slower}).to_json())
    results = spawn(3, [os.path.join(ROOT, "hethub", "cli", "bench_worker.py"), "--mode", "hethub", "--hetero-plan",
                        str(tmp_path / "plan.json"), "--model-json", str(tmp_path / "model.json"), "--emulate",
                        "SLOW=1.001", "--steps", "1", "--warmup", "0", "--memory-out", str(mem), "--out",
                        str(tmp_path / "out.json"), "--timeline", str(tmp_path / "timeline")], timeout=120,
                    extra_env={"HETHUB_EMULATE_PROFILES": str(pins)})
    assert all(rc == 0 for rc, _o, _e in results), [e[-2000:] for _rc, _o, e in results]
    pinned = CostModel(cluster, model, dtype="fp32", profiles=[Profile.model_validate_json(f.read_text())
                                                                 for f in sorted(pins.iterdir())])
    for s, st in enumerate(plan.stages):
        fwd, bwd, wgt = pass_times_s(pinned, "SLOW", st.layers[0], st.layers[1], 2, False, 1, s > 0)
        took = {"F": [], "B": [], "W": []}
        for name, start, end, wait in json.loads((tmp_path / f"timeline.{st.replicas[0].rank}").read_text()):
            if name[0] in took:
                took[name[0]].append(end - start - wait)
        assert len(took["F"]) == 4 and len(took["W"]) == (4 if s > 0 else 0), (s, took)
        assert min(took["F"]) >= fwd and min(took["B"]) >= bwd, (s, took, fwd, bwd)
        assert s == 0 or min(took["W"]) >= wgt > 0, (s, took, wgt)
    for s, st in enumerate(plan.stages):
        rank = st.replicas[0].rank
        held = json.loads((tmp_path / f"held.{rank}").read_text())["activation_peak_bytes"]
        assert activation_peak_bytes(plan, cm, s, 2) == pytest.approx(held, rel=0.05), s
        if s > 0:
            in_flight = 2 if s == 2 else min(3 - s, 4)
            forward_only = float(cm.act_bytes()[st.layers[0]:st.layers[1]].sum()) * 2 * in_flight
            assert forward_only < 0.85 * held, s
