"""Worker for what trainers do beyond ``train_batch`` N times: evaluation before, between and after training
steps; stages that start with an in-place op; frozen layers (a stage with no trainable parameter, a stage whose
input needs no gradient); sequence lengths that change between steps and between micro-batches.

usage: train_patterns.py PLAN OUT STEPS [single] [inplace] [vary] [frozen=I-J] [evals]
       [schedule=1f1b|zb-h1|interleaved-1f1b|zb-v]

inplace: every hidden block starts with ``nn.ReLU(inplace=True)`` (DeepSpeed's tutorial cuts there), so a stage
that starts at one modifies what it received. vary: inputs are (rows, T, features) with T changing per micro-batch
and per step. frozen=I-J: layers I..J (inclusive) have ``requires_grad=False``. evals: an evaluation before the
first step, after each step, and at the end (each over 2 micro-batches). Saves losses, eval losses and weights;
float64 throughout, SGD with clipping, so the comparison with one process is exact.
"""
import os
import sys

import torch
from torch import nn

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
IN, HID, OUT, CLIP, LR = 6, 12, 3, 0.05, 0.1


def make_layers(n: int, inplace: bool, frozen: range) -> list:
    torch.manual_seed(4321)
    layers = [nn.Linear(IN, HID)]
    for _ in range(n - 2):
        # in place: ReLU writes into the previous block's Linear output (which its backward does not need)
        block = [nn.ReLU(inplace=True), nn.Linear(HID, HID)] if inplace else [nn.Linear(HID, HID), nn.Tanh()]
        layers.append(nn.Sequential(*block))
    layers.append(nn.Sequential(*([nn.ReLU(inplace=True)] if inplace else []), nn.Linear(HID, OUT)))
    for i in frozen:
        layers[i].requires_grad_(False)
    return layers


def micro_batch(step: int, m: int, rows: int, vary: bool):
    g = torch.Generator().manual_seed(7_919 * (step + 3) + m)
    shape = (rows, 1 + (step * 5 + m * 3) % 4) if vary else (rows,)  # T from 1 to 4: bucketed lengths
    return torch.randn(*shape, IN, generator=g), torch.randn(*shape, OUT, generator=g)


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def main():
    plan_path, out_path, steps = sys.argv[1], sys.argv[2].replace("{rank}", os.environ.get("RANK", "0")), int(sys.argv[3])
    flags = sys.argv[4:]
    inplace, vary, evals = "inplace" in flags, "vary" in flags, "evals" in flags
    frozen = next((a[7:] for a in flags if a.startswith("frozen=")), "")
    frozen = range(int(frozen.split("-")[0]), int(frozen.split("-")[1]) + 1) if frozen else range(0)
    schedule = next((a[9:] for a in flags if a.startswith("schedule=")), None)
    from hethub.partitioner import load_plan
    plan = load_plan(plan_path)
    if schedule:
        plan = plan.model_copy(update={"schedule": schedule})
    layers = make_layers(plan.model.num_planner_layers, inplace, frozen)
    mb, M = plan.micro_batch_size, plan.num_micro_batches
    batches = lambda step, n: [micro_batch(step, m, mb, vary) for m in range(n)]  # noqa: E731
    eval_at = set(range(-1, steps)) if evals else set()  # -1: before the first step
    losses, eval_losses = [], []
    if "single" in flags:
        model = nn.Sequential(*layers)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

        def evaluate(step):
            with torch.no_grad():
                return sum(loss_fn(model(x), y).item() for x, y in batches(100 + step, 2)) / 2

        for step in range(-1, steps):
            if step >= 0:
                opt.zero_grad()
                total = 0.0
                for x, y in batches(step, M):
                    value = loss_fn(model(x), y) / M
                    value.backward()
                    total += value.item()
                nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
                opt.step()
                losses.append(total)
            if step in eval_at:
                eval_losses.append(evaluate(step))
        mine = range(len(layers))
    else:
        import hethub
        engine, *_ = hethub.initialize(layers=layers, loss_fn=loss_fn, plan=plan,
                                       config={"gradient_clipping": CLIP, "hetero": {"bucket_mb": 0.001}},
                                       optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        for step in range(-1, steps):
            if step >= 0:
                losses.append(float(engine.train_batch(iter(batches(step, M)))))
            if step in eval_at:
                eval_losses.append(float(engine.eval_batch(iter(batches(100 + step, 2)), num_micro_batches=2)))
        mine = [i for a, b in engine.grid.stage.chunk_ranges for i in range(a, b)]
    params = {f"{i}.{k}": v for i in mine for k, v in layers[i].state_dict().items()}
    torch.save({"losses": torch.tensor(losses), "eval_losses": torch.tensor(eval_losses), "params": params},
               out_path)


if __name__ == "__main__":
    main()
