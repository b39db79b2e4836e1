"""Worker for the elastic tests: train the layer stack (float64) until step LAST under an elastic start.

usage: elastic.py PLAN OUT DIR EVERY LAST HOSTS [BACKGROUND]   ({rank} in OUT: this rank; HOSTS: each rank's host,
                                                 comma-separated; BACKGROUND 0: checkpoints written at the step)
       elastic.py single OUT LAST                 (one process: the reference)
       elastic.py --hetero-plan PLAN LOG LAST STEP_S [HOLD:WORLD]  (under hethub launch --elastic: rank 0 appends
                   a JSON line per step to LOG; each step lasts at least STEP_S seconds; with HOLD:WORLD, a world
                   smaller than WORLD waits before step HOLD, up to HOLD_S, for the restart a returning host brings)
Each step's data is the global batch of that step (seeded by the step), cut into the micro-batches of the plan in
force, so any plan sees the same samples at the same step. The worker sets what ``hethub launch --elastic`` sets
on each host (HETHUB_HOST, LOCAL_RANK) from HOSTS.
"""
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_stack import IN, OUT, loss_fn, make_layers  # noqa: E402

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
GLOBAL, LAYERS, LR = 8, 7, 0.1
HOLD_S = 120.0  # longer than any test waits for a regrowth: a smaller world never runs to the end before it


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL, IN, generator=g), torch.randn(GLOBAL, OUT, generator=g)


def launched():
    """Under ``hethub launch --elastic``: the launcher set the host, the checkpoint directory and interval."""
    import argparse
    import time
    import hethub
    p = argparse.ArgumentParser()
    hethub.add_config_arguments(p)
    p.add_argument("log")
    p.add_argument("last", type=int)
    p.add_argument("step_s", type=float)
    p.add_argument("hold", nargs="?", default="-1:0")
    a = p.parse_args()
    hold_step, hold_world = (int(v) for v in a.hold.split(":"))
    engine, *_ = hethub.initialize(layers=make_layers(LAYERS), loss_fn=loss_fn, config={"hetero": {"timeout_s": 20}, "gradient_clipping": 0.0},
                                   args=a, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    mb = engine.plan.micro_batch_size
    for step in range(engine.global_steps, a.last):
        if step == hold_step and int(os.environ["WORLD_SIZE"]) < hold_world:
            time.sleep(HOLD_S)  # both ranks hold here, with no collective open; the agent's restart ends the sleep
        t0 = time.time()
        x, y = global_batch(step)
        loss = float(engine.train_batch(iter([(x[i:i + mb], y[i:i + mb]) for i in range(0, GLOBAL, mb)])))
        if engine.global_rank == 0:  # at once: a restart may stop this worker during the sleep, its step saved
            with open(a.log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "t": time.time(),
                                    "world": int(os.environ["WORLD_SIZE"])}) + "\n")
        time.sleep(max(0.0, a.step_s - (time.time() - t0)))


def main():
    if sys.argv[1] == "--hetero-plan":
        launched()
        return
    if sys.argv[1] == "single":
        out, last = sys.argv[2], int(sys.argv[3])
        model = nn.Sequential(*make_layers(LAYERS))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = {}
        for step in range(last):
            x, y = global_batch(step)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses[step] = loss.item()
        with open(out, "w") as f:
            json.dump({"losses": losses}, f)
        return
    plan, out, ckpt, every, last, hosts = sys.argv[1:7]
    background = sys.argv[7:8] != ["0"]
    rank = int(os.environ["RANK"])
    hosts = hosts.split(",")
    os.environ["HETHUB_HOST"] = hosts[rank]
    os.environ["LOCAL_RANK"] = str(hosts[:rank].count(hosts[rank]))
    import hethub
    config = {"hetero": {"elastic": True, "checkpoint_dir": ckpt, "checkpoint_every": int(every), "timeout_s": 30,
                         "checkpoint_background": background},
              "gradient_clipping": 0.0}  # DeepSpeed's default clips at 1.0; the reference does not clip
    engine, *_ = hethub.initialize(layers=make_layers(LAYERS), loss_fn=loss_fn, config=config, plan=plan,
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    first, losses = engine.global_steps, {}
    mb = engine.plan.micro_batch_size
    for step in range(first, int(last)):
        x, y = global_batch(step)
        losses[step] = float(engine.train_batch(iter([(x[i:i + mb], y[i:i + mb]) for i in range(0, GLOBAL, mb)])))
    with open(out.replace("{rank}", str(rank)), "w") as f:
        json.dump({"first": first, "losses": losses, "world": int(os.environ["WORLD_SIZE"]),
                   "plan_world": engine.plan.world_size, "hosts": sorted({r.host for st in engine.plan.stages
                                                                          for r in st.replicas})}, f)


if __name__ == "__main__":
    main()
