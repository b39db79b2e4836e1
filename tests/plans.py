"""Plans, layer stacks and runners several test files share (a helper module: no test imports another test file).

``run_and_compare`` is the runtime's equivalence oracle: a plan's ranks train N steps of SGD with clipping and
must give the losses and final weights of one process training the same layers on the same batches.
"""
import os

import torch

from dist_util import run_python, spawn
from hethub.partitioner import Cluster, ModelConfig, Plan
from hethub.partitioner.groups import SEND_WINDOW
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.schedule import build_schedule, format_schedule
from instances import CASES, CPU_CLUSTER, STACK, stack_plan

__all__ = ["CASES", "CPU_CLUSTER", "STACK", "stack_plan", "STEPS", "CLIP", "WORKER", "single_process", "run_and_compare",
           "write_schedule", "write_plan", "unequal_plan", "stack_layers"]

WORKER = os.path.join("tests", "workers", "train_stack.py")
STEPS, CLIP = 10, 0.05  # the clip threshold is low enough that clipping is active on every step


REFERENCE_FLAGS = ("f64", "tie=")  # worker flags the one-process reference takes too: they change the model


def single_process(tmp_path, plan_path, extra=()):
    out = str(tmp_path / "single.pt")
    flags = [e for e in extra if e.startswith(REFERENCE_FLAGS)]
    r = run_python([WORKER, plan_path, out, str(STEPS), str(CLIP), "single", *flags], timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out, weights_only=True)


def run_and_compare(tmp_path, plan, rtol, atol, sched=None, extra=()):
    plan_path = str(tmp_path / "plan.json")
    with open(plan_path, "w") as f:
        f.write(plan.to_json())
    extra = [*extra, f"schedule={write_schedule(tmp_path, sched)}"] if sched else list(extra)
    results = spawn(plan.world_size, [WORKER, plan_path, str(tmp_path / "rank{rank}.pt"), str(STEPS), str(CLIP),
                                      *extra], timeout=90)
    for rank, (rc, _out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"
    ref = single_process(tmp_path, plan_path, extra)
    seen = set()
    got = {}
    for rank in range(plan.world_size):
        got = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=True)
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=rtol, atol=0)
        torch.testing.assert_close(got["eval_loss"], ref["eval_loss"], rtol=rtol, atol=0)
        for k, v in got["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=0, atol=atol, msg=f"rank {rank} param {k}")
            seen.add(k)
    assert seen == set(ref["params"]), "every layer's weights were checked"
    sched = sched or build_schedule(plan)
    held = []
    for rank in range(plan.world_size):  # each rank ran exactly its schedule's actions, in order
        out = torch.load(str(tmp_path / f"rank{rank}.pt"), weights_only=True)
        assert out["trace"] == format_schedule(sched[rank]), f"rank {rank}"
        held.append(out["sends_held"])
    # sends held at once per (direction, peer): never past the window, whatever M (the ranks that send hold some)
    assert max(held) <= SEND_WINDOW and (max(held) >= 1 or len(plan.pipeline) == 1), held
    # Sanity: training moved the weights and the loss.
    assert not torch.equal(ref["losses"][0], ref["losses"][-1])
    return got, ref


def write_schedule(tmp_path, sched) -> str:
    path = str(tmp_path / "schedule.txt")
    with open(path, "w") as f:
        f.write("# rank: actions\n" + "".join(f"{r}: {format_schedule(a)}\n" for r, a in sorted(sched.items())))
    return path


def write_plan(tmp_path, plan):
    path = str(tmp_path / "plan.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    return path


UNEQUAL = Cluster.model_validate({
    "name": "unequal", "device_types": {"X": {"vendor": "cpu", "peak_tflops": 1, "memory_gib": 8, "memory_gbps": 10}},
    "nodes": [{"host": "big", "device_type": "X", "count": 3}, {"host": "small", "device_type": "X", "count": 2}]})
MODEL = ModelConfig(name="m", architecture="gpt", num_layers=2, hidden_size=8, num_attention_heads=2,
                    ffn_hidden_size=16, vocab_size=16, seq_length=4)


def unequal_plan() -> Plan:
    # stage 0 on 2 slots, stage 1 on 3: the placement puts them on nodes with 3 and 2 slots
    return build_plan(MODEL, UNEQUAL, [StageLayout((0, 2), "X", (2, 2)), StageLayout((2, 4), "X", (2, 1, 1))], 4, 2)


def stack_layers():
    from torch import nn
    return [nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)), nn.Linear(16, 4)]
