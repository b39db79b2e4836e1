"""Host time per micro-batch on each stage, and the profiler's timed passes with and without its hooks.

Why: on a GPU the host must stay ahead of the device, so the runtime's per-action Python (loads, metadata,
transfers, the step's collectives) is the cost that matters; on this CPU it is measured directly as each action's
seconds minus the seconds it waited for data (``engine.executed_s``). A small layer stack keeps compute small so
that host work dominates. Plan: widths 1 -> 2 -> 2, uneven split, M = 8, float32, SGD with clipping.

    python benchmarks/host_path.py [--steps N] [--out FILE]       # one tree: prints JSON
    python benchmarks/host_path.py --profiler                     # the profiler's forward, hooks vs none

To compare two versions side by side, run it alternately on each checkout (``--label``) and put the medians in
``benchmarks/results/host_path.md``.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def worker(plan_path: str, out_path: str, steps: int) -> None:
    import torch
    from torch import nn
    import hethub
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64)] + [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(5)] + [nn.Linear(64, 4)]
    engine, *_ = hethub.initialize(layers=layers, loss_fn=nn.functional.mse_loss, plan=plan_path,
                                   config={"gradient_clipping": 1.0},
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    M, mb = engine.plan.num_micro_batches, engine.plan.micro_batch_size
    per_mb, by_kind, step_ms = [], {}, []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        batches = [(torch.randn(mb, 16, generator=g), torch.randn(mb, 4, generator=g)) for _ in range(M)]
        t0 = time.perf_counter()
        engine.train_batch(iter(batches))
        step_ms.append((time.perf_counter() - t0) * 1e3)
        # the micro-batches' own actions (the step's AR and OPT are per step, reported in step_ms)
        host = sum(end - start - wait for text, (start, end, wait) in zip(engine.executed, engine.executed_s)
                   if text not in ("AR", "OPT"))
        per_mb.append(host / M * 1e3)
        if step >= 2:
            for text, (start, end, wait) in zip(engine.executed, engine.executed_s):
                kind = text.rstrip("0123456789").split("<")[0].split(">")[0].rstrip("0123456789@")
                by_kind.setdefault(kind, []).append((end - start - wait) * 1e3)
    with open(out_path.replace("{rank}", os.environ["RANK"]), "w") as f:
        json.dump({"stage": engine.grid.stage_id, "host_ms_per_micro_batch": per_mb[2:], "step_ms": step_ms[2:],
                   "by_kind": {k: statistics.median(v) for k, v in by_kind.items()}}, f)


def run_plan(steps: int) -> dict:
    import tempfile
    from dist_util import spawn
    from plans import stack_plan
    plan = stack_plan([2, 5], [[8], [4, 4], [3, 5]], 8, 8)
    tmp = tempfile.mkdtemp(prefix="hethub-host-")
    path = os.path.join(tmp, "plan.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    out = os.path.join(tmp, "r{rank}.json")
    results = spawn(plan.world_size, [os.path.abspath(__file__), "--worker", path, out, str(steps)], timeout=300)
    for r, (rc, _o, err) in enumerate(results):
        if rc != 0:
            raise SystemExit(f"rank {r} failed:\n{err[-2000:]}")
    per_stage: dict[int, list[float]] = {}
    kinds: dict[str, dict] = {}
    steps_ms: list[float] = []
    for r in range(plan.world_size):
        with open(out.replace("{rank}", str(r))) as f:
            got = json.load(f)
        per_stage.setdefault(got["stage"], []).extend(got["host_ms_per_micro_batch"])
        steps_ms += got["step_ms"]
        kinds.setdefault(f"stage {got['stage']} by action (ms)", {k: round(v, 4) for k, v in got["by_kind"].items()})
    return {**{f"stage {s}": round(statistics.median(v), 4) for s, v in sorted(per_stage.items())},
            "step_ms": round(statistics.median(steps_ms), 3), **kinds}


def profiler_hooks(reps: int = 30) -> dict:
    """Median forward ms of the demo's block with the activation meter's hooks on (what the profiler timed
    before) and off (what it times now)."""
    import torch
    from hethub.cli.demo import DEMO_MODEL
    from hethub.models.builtin import Block
    from hethub.partitioner import ModelConfig
    from hethub.runtime.activations import ActivationMeter
    torch.set_num_threads(1)
    model = ModelConfig.model_validate(DEMO_MODEL)
    block = Block(model)
    x = torch.randn(2, model.seq_length, model.hidden_size, requires_grad=True)
    times = {"with hooks": [], "without hooks": []}
    for it in range(reps):
        for name in times:
            meter = ActivationMeter(block.parameters()) if name == "with hooks" else None
            t0 = time.perf_counter()
            if meter is not None:
                with meter:
                    y = block(x)
            else:
                y = block(x)
            times[name].append((time.perf_counter() - t0) * 1e3)
            y.sum().backward()
    return {k: round(statistics.median(v[3:]), 4) for k, v in times.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profiler", action="store_true")
    p.add_argument("--label", default="")
    args = p.parse_args()
    got = profiler_hooks() if args.profiler else run_plan(args.steps)
    print(json.dumps({"label": args.label, "load": os.getloadavg()[0], **got}))


if __name__ == "__main__":
    main()
