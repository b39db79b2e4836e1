"""Tier 2 (multi-process gloo, strict issue order): what training runs really do trains like one process.

Evaluation before, between and after training steps; a stage that starts with an in-place op on what it
received; frozen layers (a stage with no trainable parameter, a stage whose input needs no gradient); sequence
lengths that change between steps and between micro-batches. Each runs a plan of unequal widths under 1F1B and
zb-h1 and must give one process's losses, evaluation losses and weights (float64, SGD with clipping).
"""
import os
import sys

import pytest
import torch

from conftest import ROOT
from dist_util import run_python, spawn
from plans import stack_plan, write_plan

pytestmark = pytest.mark.dist
pytest.importorskip("deepspeed")

WORKER = os.path.join("tests", "workers", "train_patterns.py")
STEPS = 3


def run_pattern(tmp_path, plan, *flags, steps=STEPS):
    path = write_plan(tmp_path, plan)
    results = spawn(plan.world_size, [WORKER, path, str(tmp_path / "rank{rank}.pt"), str(steps), *flags],
                    timeout=120)
    for rank, (rc, _out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"
    ref_out = str(tmp_path / "single.pt")
    r = run_python([WORKER, path, ref_out, str(steps), "single", *flags], timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = torch.load(ref_out, weights_only=True)
    seen = set()
    for rank in range(plan.world_size):
        got = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=True)
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-12, atol=0)
        torch.testing.assert_close(got["eval_losses"], ref["eval_losses"], rtol=1e-12, atol=0)
        for k, v in got["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=0, atol=1e-12, msg=f"rank {rank} param {k}")
            seen.add(k)
    assert seen == set(ref["params"])
    return ref


UNEQUAL = ([2, 5], [[4], [2, 2], [1, 3]], 4, 4)  # 1 -> 2 -> 2 replicas, an uneven split at the end, M = 4


@pytest.mark.parametrize("schedule", ["1f1b"])  # zb-h1: in test_every_pattern_at_once_under_every_schedule
def test_evaluation_before_between_and_after_training(tmp_path, schedule):
    ref = run_pattern(tmp_path, stack_plan(*UNEQUAL), "evals", f"schedule={schedule}")
    assert len(ref["eval_losses"]) == STEPS + 1 and len(set(ref["eval_losses"].tolist())) == STEPS + 1


@pytest.mark.parametrize("schedule", ["zb-h1"])  # 1f1b: in test_every_pattern_at_once_under_every_schedule
def test_stages_that_start_with_an_inplace_op(tmp_path, schedule):
    """Every hidden block starts with nn.ReLU(inplace=True): stages 1 and 2 write into what they received."""
    run_pattern(tmp_path, stack_plan(*UNEQUAL), "inplace", "evals", f"schedule={schedule}")


@pytest.mark.parametrize("frozen, schedule", [("0-1", "zb-h1"), ("0-2", "1f1b"), ("2-4", "1f1b"), ("2-4", "zb-h1"),
                                              ("0-5", "zb-h1")])  # 0-1 under 1f1b: in the every-pattern test
def test_frozen_layers(tmp_path, frozen, schedule):
    """0-1: stage 0 has no trainable parameter and sends activations that need no gradient (stage 1's inputs);
    0-2: stage 1 partly frozen too; 2-4: stage 1 wholly frozen between two trained stages (it passes gradients
    through); 0-5: only the head trains. Frozen weights stay as they were; the others train like one process."""
    plan = stack_plan(*UNEQUAL)
    ref = run_pattern(tmp_path, plan, f"frozen={frozen}", "evals", f"schedule={schedule}")
    first, last = (int(i) for i in frozen.split("-"))
    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    import train_patterns
    torch.set_default_dtype(torch.float64)
    try:
        initial = train_patterns.make_layers(plan.model.num_planner_layers, False, range(0))
    finally:
        torch.set_default_dtype(torch.float32)
    for i, layer in enumerate(initial):
        for k, v in layer.state_dict().items():
            assert torch.equal(ref["params"][f"{i}.{k}"], v) == (first <= i <= last), (i, k)


@pytest.mark.parametrize("schedule", ["1f1b"])  # zb-h1: in test_every_pattern_at_once_under_every_schedule
def test_shapes_that_change_between_micro_batches_and_steps(tmp_path, schedule):
    """Inputs of (rows, T, features), T from 1 to 4 changing per micro-batch and per step (bucketed lengths),
    with evaluation between steps and in-place stage starts: trained, not refused."""
    run_pattern(tmp_path, stack_plan(*UNEQUAL), "vary", "evals", "inplace", f"schedule={schedule}", steps=4)


def _everything_plans():
    from hethub.partitioner.chunked import rechunk
    three = stack_plan([2, 4], [[4], [2, 2], [1, 3]], 4, 4)
    return {
        "1f1b-M1": stack_plan([2, 5], [[4], [2, 2], [1, 3]], 4, 1),
        "zb-h1-M8": stack_plan([2, 5], [[4], [2, 2], [1, 3]], 4, 8).model_copy(update={"schedule": "zb-h1"}),
        "bridge-3to2": stack_plan([3], [[2, 2, 2], [3, 3]], 6, 3, [{"after_stage": 0, "transport": "host"}]),
        "interleaved": rechunk(three, "interleaved-1f1b", 2),
        "zb-v": rechunk(three, "zb-v", 2),
    }


@pytest.mark.parametrize("name", ["1f1b-M1", "zb-h1-M8", "bridge-3to2", "interleaved", "zb-v"])
def test_every_pattern_at_once_under_every_schedule(tmp_path, name):
    """Evaluation first and between steps, in-place stage starts, a frozen first stage, lengths changing per
    micro-batch: M = 1 and 8, the host bridge, and both chunked schedules (zb-v hands its turn to itself)."""
    run_pattern(tmp_path, _everything_plans()[name], "evals", "inplace", "vary", "frozen=0-1")


@pytest.mark.parametrize("name", ["zb-h1-M8", "zb-v"])
def test_every_pattern_with_the_main_thread_reading_the_metadata_as_on_nccl(tmp_path, name, monkeypatch):
    """On NCCL the main thread reads each metadata message and then posts the data receives (at the next RA, the
    forward, or between actions); gloo's lanes do it themselves. HETHUB_ISSUE_AT_ONCE runs the NCCL path here."""
    monkeypatch.setenv("HETHUB_ISSUE_AT_ONCE", "1")
    run_pattern(tmp_path, _everything_plans()[name], "evals", "inplace", "vary", "frozen=0-1")
