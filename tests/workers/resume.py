"""Worker for checkpoint tests: train steps [first, last) under a plan, optionally loading/saving a checkpoint.

usage: resume.py PLAN OUT FIRST LAST OPT CLIP [--load DIR] [--save DIR] [--zero1]   (PLAN "single": one process)
OPT: sgd (with momentum) | adam. Data of step k is the same whatever the plan (seeded by k).
"""
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_stack import loss_fn, make_layers, micro_batch, reference_step  # noqa: E402

torch.set_num_threads(1)


def opt_factory(kind):
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return lambda ps: torch.optim.Adam(ps, lr=0.01)


def main():
    plan_path, out, first, last, kind, clip = sys.argv[1:7]
    first, last, clip = int(first), int(last), float(clip)
    load = sys.argv[sys.argv.index("--load") + 1] if "--load" in sys.argv else None
    save = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv else None
    mb, M, n_layers = 6, 2, 7
    layers = make_layers(n_layers)
    losses, opt_bytes = [], 0
    if plan_path == "single":
        model = nn.Sequential(*layers)
        opt = opt_factory(kind)(model.parameters())
        for step in range(first, last):
            losses.append(reference_step(model, opt, [micro_batch(step, m, mb) for m in range(M)], loss_fn, clip))
        params = {f"{i}.{k}": v for i, l in enumerate(layers) for k, v in l.state_dict().items()}
    else:
        import hethub
        cfg = {"gradient_clipping": clip} if clip > 0 else {}
        if "--zero1" in sys.argv:
            cfg["zero_optimization"] = {"stage": 1}
        engine, *_ = hethub.initialize(layers=layers, loss_fn=loss_fn, config=cfg, plan=plan_path,
                                       optimizer=opt_factory(kind))
        if load:
            engine.load_checkpoint(load)
            assert engine.global_steps == first, (engine.global_steps, first)
        for step in range(first, last):
            losses.append(float(engine.train_batch(iter([micro_batch(step, m, mb) for m in range(M)]))))
        if save:
            engine.save_checkpoint(save)
        mine = [i for a, b in engine.grid.stage.chunk_ranges for i in range(a, b)]  # every chunk's layers
        params = {f"{i}.{k}": v for i in mine for k, v in layers[i].state_dict().items()}
        from hethub.runtime.zero import optimizer_state_bytes
        opt_bytes = optimizer_state_bytes(engine.optimizer)
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "params": params, "opt_bytes": opt_bytes},
               out.replace("{rank}", os.environ.get("RANK", "0")))


if __name__ == "__main__":
    main()
