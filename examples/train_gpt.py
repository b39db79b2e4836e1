"""Train a small GPT under a hethub plan, on data it generates itself (no downloads).

    hethub launch --hetero-plan plan.json examples/train_gpt.py --steps 20
    deepspeed examples/train_gpt.py --hetero-plan plan.json --steps 20      (with a hostfile matching the plan)

The task is learnable: each sequence counts upwards modulo the vocabulary from a random start, so
the next token is always (token + 1) % vocab and the loss falls quickly. The model is the plan's
model (embedding, blocks, head: hethub.models.build_layers).
"""
import argparse
import json
import os
import time

import torch

import hethub
from hethub.emulated.slowdown import parse_factors
from hethub.models.builtin import build_layers, counting_batches, lm_loss
from hethub.partitioner import InputError, load_plan, print_error


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hethub.add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--deepspeed_config", default=None, help="ds_config JSON (may hold hetero.plan)")
    parser.add_argument("--emulate", default=None, help='emulated slowdown per device type, e.g. "SLOW=3"')
    parser.add_argument("--log-json", default=None, help="rank 0 writes per-step loss and seconds here")
    parser.add_argument("--save-dir", default=None, help="checkpoint directory (per-layer: loads under any plan)")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    config = {}
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            config = json.load(f)
    plan_path = args.hetero_plan or (config.get("hetero") or {}).get("plan")
    if plan_path is None:
        parser.error("--hetero-plan (or ds_config hetero.plan) is required")
    if args.emulate:
        try:
            slow = parse_factors(args.emulate, "--emulate")
        except InputError as exc:
            print_error(str(exc))
            raise SystemExit(2) from None
        config.setdefault("hetero", {})["emulate_slowdown"] = slow
    plan = load_plan(plan_path)
    m = plan.model

    torch.manual_seed(0)  # every rank builds the same initial weights
    layers = build_layers(m)
    engine, _, _, _ = hethub.initialize(layers=layers, loss_fn=lm_loss, config=config, plan=plan_path,
                                        optimizer=lambda ps: torch.optim.Adam(ps, lr=args.lr), args=args)
    rank = int(os.environ.get("RANK", "0"))
    log = []
    # Resumed runs continue at the saved step: the data of step k is the same under any plan.
    for step in range(engine.global_steps, args.steps):
        t0 = time.perf_counter()
        loss = engine.train_batch(iter(counting_batches(step, plan.num_micro_batches, plan.micro_batch_size,
                                               m.seq_length, m.vocab_size)))
        seconds = time.perf_counter() - t0
        log.append({"step": step, "loss": float(loss), "seconds": seconds})
        if rank == 0:
            print(f"step {step:3d}  loss {float(loss):.4f}  {seconds * 1e3:.1f} ms", flush=True)
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
            if rank == 0:
                print(f"saved global_step{engine.global_steps} in {args.save_dir}", flush=True)
    if rank == 0 and args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
