"""One rank of a side-by-side run (``hethub demo``, ``benchmarks/runtime.py``): the same model, data and
optimizer under hethub's plan or under vanilla DeepSpeed with its own partition.

    python -m deepspeed.launcher.runner --num_gpus N hethub/cli/bench_worker.py --mode hethub --hetero-plan P ...
    ... --mode deepspeed --stages S --micro-batch B --micro-batches M --rank-types FAST,SLOW,...

Emulated speeds come from ``--emulate TYPE=K`` (and, for vanilla DeepSpeed, which knows nothing of
device types, ``--rank-types``). Rank 0 prints one line per step (``step 3/8 loss 5.1234 0.812 s``) and
writes every step's seconds and loss to ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Optional

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

import hethub
from hethub.emulated.pinned import Pins, load_pin_profiles, pins_for, slowed_chunk
from hethub.emulated.slowdown import DeviceClock, SlowDown, parse_factors
from hethub.models.builtin import build_layers, counting_batches, lm_loss
from hethub.partitioner import ModelConfig
from hethub.partitioner.records import load_plan
from hethub.runtime.activations import ActivationMeter
from hethub.runtime.startup import init_distributed
from hethub.runtime.zero import optimizer_state_bytes


def _vanilla_deepspeed(a: argparse.Namespace, layers: list, factors: dict, optimizer):
    """DeepSpeed's own pipeline: PipelineModule(partition_method=...), equal widths, its TrainSchedule."""
    init_distributed(300)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rtype = a.rank_types.split(",")[rank]
    k = factors.get(rtype, 1.0)
    dp = world // a.stages
    pins = _vanilla_pins(a, rank // dp, rtype, a.micro_batch // dp) if k != 1.0 else None
    if k != 1.0:  # pinned: this stage's layers queue on one device clock, as hethub's ranks' do
        first, last = (min(pins.layer_s), max(pins.layer_s) + 1) if pins else (0, 0)
        layers = ([SlowDown(layer, k) for layer in layers[:first]] + slowed_chunk(layers[first:last], first, k, pins,
                  DeviceClock()) + [SlowDown(layer, k) for layer in layers[last:]])
    module = PipelineModule(layers=layers, loss_fn=lm_loss, num_stages=a.stages, partition_method=a.partition)
    if pins:  # pins for other layers than DeepSpeed's stage holds would time another partition than it runs
        held = (module.parts[rank // dp], module.parts[rank // dp + 1])
        if held != (first, last):
            raise SystemExit(f"error: --pin-plan: DeepSpeed's stage {rank // dp} holds layers [{held[0]}, {held[1]}), "
                             f"the pin plan's [{first}, {last})")
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch // dp, "gradient_accumulation_steps": a.micro_batches,
           "train_batch_size": a.micro_batch * a.micro_batches, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=module, config=cfg, optimizer=optimizer(module.parameters()))
    return engine, dp


def _vanilla_pins(a: argparse.Namespace, stage: int, device_type: str, rows: int) -> Optional[Pins]:
    """Vanilla DeepSpeed's layers pinned as hethub's are (``HETHUB_EMULATE_PROFILES``, ``hethub.emulated.pinned``):
    ``--pin-plan`` is a hethub plan of the same layout (stage s = DeepSpeed's stage s, one-chunk 1F1B, no split
    backward), whose layer times the profiles give; None where not pinned."""
    profiles = load_pin_profiles()
    if profiles is None or not a.pin_plan:
        return None
    return pins_for(load_plan(a.pin_plan), profiles, stage, device_type, rows, set())


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hethub.add_config_arguments(p)
    p.add_argument("--mode", choices=["hethub", "deepspeed"], required=True)
    p.add_argument("--model-json", required=True)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--stages", type=int, default=5)
    p.add_argument("--partition", default="parameters")
    p.add_argument("--rank-types", default="")
    p.add_argument("--emulate", default="")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True)
    p.add_argument("--pin-plan", default=None, help="deepspeed mode, under HETHUB_EMULATE_PROFILES: the hethub plan "
                                                    "of the same layout whose layer times pin the emulated layers")
    p.add_argument("--timeline", default=None, help="write each rank's per-action times (hethub mode) to FILE.RANK")
    p.add_argument("--zero1", action="store_true", help="hethub mode: ZeRO-1 within each stage")
    p.add_argument("--bucket-mb", type=float, default=None, help="hethub mode: the gradient bucket (hetero.bucket_mb)")
    p.add_argument("--state-out", default=None, help="hethub mode: write each rank's optimizer-state bytes to FILE.RANK")
    p.add_argument("--memory-out", default=None, help="hethub mode: write each rank's peak activation bytes (what "
                                                       "autograd holds for backward) to FILE.RANK")
    p.add_argument("--checkpoint-dir", default=None, help="hethub mode: the engine saves here by itself")
    p.add_argument("--checkpoint-every", type=int, default=0, help="hethub mode: every N steps (hetero.checkpoint_every)")
    p.add_argument("--checkpoint-at-step", action="store_true", help="hethub mode: written at the step, not by a "
                                                                      "thread (hetero.checkpoint_background false)")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def _write_rank_files(a: argparse.Namespace, engine, rank: int, meter: ActivationMeter) -> None:
    """hethub mode: each rank's action timeline, optimizer-state bytes and peak activation bytes, where asked for."""
    if a.timeline:
        t0 = engine.executed_s[0][0]
        with open(f"{a.timeline}.{rank}", "w", encoding="utf-8") as f:
            json.dump([(n, s - t0, e - t0, w) for n, (s, e, w) in zip(engine.executed, engine.executed_s)], f)
    if a.state_out:
        with open(f"{a.state_out}.{rank}", "w", encoding="utf-8") as f:
            json.dump({"opt_bytes": optimizer_state_bytes(engine.optimizer)}, f)
    if a.memory_out:
        with open(f"{a.memory_out}.{rank}", "w", encoding="utf-8") as f:
            json.dump({"activation_peak_bytes": meter.peak}, f)


def main() -> None:
    a = _args()
    torch.set_num_threads(1)
    with open(a.model_json, encoding="utf-8") as f:
        model = ModelConfig.model_validate_json(f.read())
    factors = parse_factors(a.emulate, "--emulate")
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    layers = build_layers(model)
    optimizer = lambda ps: torch.optim.Adam(ps, lr=a.lr)  # noqa: E731
    dp = 1
    if a.mode == "hethub":
        config = {"hetero": {"emulate_slowdown": factors}}
        if a.zero1:
            config["zero_optimization"] = {"stage": 1}
        if a.bucket_mb is not None:
            config["hetero"]["bucket_mb"] = a.bucket_mb
        if a.checkpoint_every:
            config["hetero"].update(checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every,
                                    checkpoint_background=not a.checkpoint_at_step)
        engine, *_ = hethub.initialize(layers=layers, loss_fn=lm_loss, plan=a.hetero_plan, optimizer=optimizer,
                                       config=config)
        mb, M = engine.plan.micro_batch_size, engine.plan.num_micro_batches
    else:
        engine, dp = _vanilla_deepspeed(a, layers, factors, optimizer)
        mb, M = a.micro_batch, a.micro_batches
    meter = ActivationMeter(engine.module.parameters() if a.mode == "hethub" else ())
    log = []
    for step in range(a.steps):
        data = counting_batches(step, M, mb, model.seq_length, model.vocab_size)
        if a.mode == "deepspeed":  # vanilla DeepSpeed: each data-parallel replica reads its own rows
            rep = engine.grid.data_parallel_id
            data = [(x[rep::dp], y[rep::dp]) for x, y in data]
        t0 = time.perf_counter()
        with meter if a.memory_out else contextlib.nullcontext():
            loss = float(engine.train_batch(iter(data)))
        log.append({"step": step, "loss": loss, "seconds": time.perf_counter() - t0})
        if a.mode == "hethub":  # seconds the step's AR action waited: the all-reduce the backward did not hide
            log[-1]["ar_s"] = sum(e - s for n, (s, e, _) in zip(engine.executed, engine.executed_s) if n.startswith("AR"))
        if rank == 0:
            print(f"step {step + 1}/{a.steps} loss {loss:.4f} {log[-1]['seconds']:.3f} s", flush=True)
    if a.mode == "hethub":
        _write_rank_files(a, engine, rank, meter)
    if rank == 0:
        times = [e["seconds"] for e in log]
        timed = times[min(a.warmup, len(times) - 1):]  # after the warm-up steps
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"log": log, "times": times, "median_s": statistics.median(timed), "timed": timed}, f)


if __name__ == "__main__":
    main()
