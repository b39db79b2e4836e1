"""One rank of the runtime benchmark: the same model, data and optimizer under hethub or vanilla DeepSpeed.

    --mode hethub     hethub.initialize under --hetero-plan
    --mode deepspeed  deepspeed.initialize with PipelineModule(partition_method=...), equal widths
Emulated speeds come from --emulate TYPE=K and --rank-types (device type per rank, for vanilla DeepSpeed,
which knows nothing of types).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import hethub  # noqa: E402
from hethub.emulation import SlowDown  # noqa: E402
from hethub.models import build_layers, lm_loss  # noqa: E402
from hethub.partitioner import ModelConfig  # noqa: E402
from train_gpt import batches  # noqa: E402


def main():
    p = argparse.ArgumentParser()
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
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = ModelConfig.model_validate_json(open(a.model_json).read())
    factors = {k: float(v) for k, v in (i.split("=") for i in a.emulate.split(",") if i)}
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    layers = build_layers(model)
    opt = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    if a.mode == "hethub":
        engine, *_ = hethub.initialize(layers=layers, loss_fn=lm_loss, plan=a.hetero_plan, optimizer=opt,
                                       config={"hetero": {"emulate_slowdown": factors}})
        mb, M = engine.plan.micro_batch_size, engine.plan.num_micro_batches
    else:
        import deepspeed
        from deepspeed.pipe import PipelineModule

        from hethub.runtime import _init_distributed
        _init_distributed(300)
        world = int(os.environ["WORLD_SIZE"])
        rtype = a.rank_types.split(",")[rank]
        layers = [SlowDown(l, factors.get(rtype, 1.0)) if factors.get(rtype, 1.0) != 1.0 else l for l in layers]
        module = PipelineModule(layers=layers, loss_fn=lm_loss, num_stages=a.stages, partition_method=a.partition)
        dp = world // a.stages
        cfg = {"train_micro_batch_size_per_gpu": a.micro_batch // dp, "gradient_accumulation_steps": a.micro_batches,
               "train_batch_size": a.micro_batch * a.micro_batches, "steps_per_print": 10 ** 9}
        engine, *_ = deepspeed.initialize(model=module, config=cfg, optimizer=opt(module.parameters()))
        mb, M = a.micro_batch, a.micro_batches
    times = []
    for step in range(a.steps):
        data = batches(step, M, mb, model.seq_length, model.vocab_size)
        if a.mode == "deepspeed":  # vanilla DeepSpeed: each data-parallel replica reads its own rows
            dp = int(os.environ["WORLD_SIZE"]) // a.stages
            rep = engine.grid.data_parallel_id
            data = [(x[rep::dp], y[rep::dp]) for x, y in data]
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        times.append(time.perf_counter() - t0)
    if os.environ.get("HETHUB_BENCH_TIMELINE") and a.mode == "hethub":  # per-action wall times, last iteration
        t0 = engine.executed_s[0][0]
        with open(f"{os.environ['HETHUB_BENCH_TIMELINE']}.{rank}", "w") as f:
            json.dump([(n, s - t0, e - t0, w) for n, (s, e, w) in zip(engine.executed, engine.executed_s)], f)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"times": times, "median_s": statistics.median(times[a.warmup:])}, f)


if __name__ == "__main__":
    main()
