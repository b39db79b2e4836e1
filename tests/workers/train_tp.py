"""Worker for the tensor-parallel tests: train under a plan (or in one process, the reference) in float64,
SGD with gradient clipping, optionally resuming from / saving a checkpoint.

usage: train_tp.py PLAN OUT STEPS {gpt|llama|user} [single] [--first K] [--load DIR] [--save DIR] [zero1] [bf16]
    [momentum]
momentum: SGD with momentum 0.9 (optimizer state that checkpoints and ZeRO-1 must carry exactly).
bf16: float32 weights with bf16 autocast (the reference autocasts the same way) instead of float64.
gpt/llama: hethub's own blocks (split with no extra argument). user: a stack of the user's layers, split by
tp_plan {"*.0": "colwise", "*.2": "rowwise"}. Trains steps [K, STEPS); data of step k is the same under any plan.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.set_num_threads(1)
LR, CLIP, IN, HID = 0.2, 0.5, 8, 16
USER_TP_PLAN = {"*.0": "colwise", "*.2": "rowwise"}


DTYPE = torch.float32 if "bf16" in sys.argv[5:] else torch.float64


def make_layers(kind: str, plan):
    torch.manual_seed(11)
    if kind == "user":
        n = plan.model.num_planner_layers
        mid = [nn.Sequential(nn.Linear(HID, 2 * HID), nn.Tanh(), nn.Linear(2 * HID, HID)) for _ in range(n - 2)]
        layers = [nn.Linear(IN, HID), *mid, nn.Linear(HID, 4)]
    else:
        from hethub.models.builtin import build_layers
        layers = build_layers(plan.model)
    return [layer.to(DTYPE) for layer in layers]


def loss_fn(out, labels):
    if labels.dtype == torch.int64:  # next-token cross entropy, in float64 (exactness)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))
    return F.mse_loss(out, labels)


def batches(kind: str, plan, step: int):
    mb, M, m = plan.micro_batch_size, plan.num_micro_batches, plan.model
    if kind == "user":
        g = torch.Generator().manual_seed(100 + step)
        return [(torch.randn(mb, IN, generator=g, dtype=torch.float64).to(DTYPE),
                 torch.randn(mb, 4, generator=g, dtype=torch.float64).to(DTYPE)) for _ in range(M)]
    from hethub.models.builtin import counting_batches
    return counting_batches(step, M, mb, m.seq_length, m.vocab_size)


def optimizer(params, argv):
    return torch.optim.SGD(params, lr=LR, momentum=0.9 if "momentum" in argv else 0.0)


def main():
    plan_path, out, steps, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    argv = sys.argv[5:]
    out = out.replace("{rank}", os.environ.get("RANK", "0"))
    from hethub.partitioner import load_plan
    plan = load_plan(plan_path)
    layers = make_layers(kind, plan)
    first_step = int(argv[argv.index("--first") + 1]) if "--first" in argv else 0
    losses = []
    if "single" in argv:
        model = nn.Sequential(*layers)
        opt = optimizer(model.parameters(), argv)
        for step in range(steps):
            opt.zero_grad()
            total = 0.0
            data = batches(kind, plan, step)
            for x, y in data:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in argv):
                    value = loss_fn(model(x), y) / len(data)
                value.backward()
                total += value.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(total)
        mine = range(len(layers))
    else:
        import hethub
        config = {"gradient_clipping": CLIP}
        if "zero1" in argv:
            config["zero_optimization"] = {"stage": 1}
        if "bf16" in argv:
            config["bf16"] = {"enabled": True}
        engine, *_ = hethub.initialize(layers=layers, loss_fn=loss_fn, config=config, plan=plan,
                                       optimizer=lambda ps: optimizer(ps, argv),
                                       tp_plan=USER_TP_PLAN if kind == "user" else None)
        if "--load" in argv:
            engine.load_checkpoint(argv[argv.index("--load") + 1])
            assert engine.global_steps == first_step, (engine.global_steps, first_step)
        for step in range(first_step, steps):
            losses.append(float(engine.train_batch(iter(batches(kind, plan, step)))))
        if "--save" in argv:
            engine.save_checkpoint(argv[argv.index("--save") + 1])
        mine = [i for a, b in engine.grid.stage.chunk_ranges for i in range(a, b)]  # every chunk's layers
    from hethub.runtime.tp import full
    params = {f"{i}.{k}": full(v).detach().clone() for i in mine
              for k, v in layers[i].state_dict(keep_vars=True).items()}
    state = [] if "single" in argv else [v for st in engine.optimizer.state.values() for v in st.values()
                                         if torch.is_tensor(v) and v.dim() > 0]
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "params": params,
                "state_elements": sum(v.numel() for v in state)}, out)


if __name__ == "__main__":
    main()
