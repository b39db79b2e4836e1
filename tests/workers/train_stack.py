"""Worker for the equivalence tests: train a small layer stack under a plan, save losses and weights.

usage: train_stack.py PLAN OUT STEPS CLIP [single] [bf16|fp16=POWER] [zero1] [schedule=PATH] [f64] [tie=I,J]
({rank} in PLAN, OUT: this rank). f64: float64 weights and data. tie=I,J: layers I and J (hidden blocks) share one
module, so its weights are tied across them. With "single", trains the same layers in one process (the reference) without hethub. fp16=POWER:
fp16 autocast, dynamic loss scale from 2**POWER, halved on each overflow (hysteresis 1), the step then skipped.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

torch.set_num_threads(1)
IN, HID, OUT = 6, 12, 3


def make_layers(n: int, seed: int = 1234, tie: tuple = ()) -> list:
    torch.manual_seed(seed)
    layers = [nn.Linear(IN, HID)]
    for _ in range(n - 2):
        layers.append(nn.Sequential(nn.Linear(HID, HID), nn.Tanh()))
    layers.append(nn.Linear(HID, OUT))
    for j in tie[1:]:
        layers[j] = layers[tie[0]]  # one module at two places of the list: a tied weight (hethub.models.ties)
    return layers


def micro_batch(step: int, m: int, mb: int):
    g = torch.Generator().manual_seed(10_000 * step + m)
    x = torch.randn(mb, IN, generator=g)
    y = torch.randn(mb, OUT, generator=g)
    return x, y


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def reference_step(model, opt, batches, loss, clip: float, cast=None, scaler=None) -> float:
    """One single-process step over a global batch of equal micro-batches: the mean loss, the
    reference every equivalence test compares hethub against. ``scaler`` ({"scale", "skipped"}): fp16's
    dynamic loss scaling as DeepSpeed's policy runs it with hysteresis 1 and a window longer than the run."""
    opt.zero_grad()
    total = 0.0
    for x, y in batches:
        with cast or contextlib.nullcontext():
            value = loss(model(x), y) / len(batches)
        (value * scaler["scale"] if scaler else value).backward()
        total += value.item()
    if scaler:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            g.mul_(1.0 / scaler["scale"])
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            scaler["scale"] = max(scaler["scale"] / 2, 1.0)
            scaler["skipped"] += 1
            return total
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return total


class WeightCasts:
    """Counts casts of the given weights to bf16 (autocast's copies) inside ``with``: (casts, distinct weights)."""

    def __init__(self, params):
        self.ptrs = {p.data_ptr() for p in params}
        self.seen: list = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        seen, ptrs = self.seen, self.ptrs

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                        and args[0].data_ptr() in ptrs):
                    seen.append(args[0].data_ptr())
                return func(*args, **kwargs)
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        return False

    def counts(self) -> list:
        return [len(self.seen), len(set(self.seen))]


def main():
    plan_path, out_path, steps, clip = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    out_path = out_path.replace("{rank}", os.environ.get("RANK", "0"))
    plan_path = plan_path.replace("{rank}", os.environ.get("RANK", "0"))  # a copy per rank, as hosts have
    single = "single" in sys.argv[5:]
    if "f64" in sys.argv[5:]:
        torch.set_default_dtype(torch.float64)  # the layers and the data: equivalence without float32 rounding
    tie = next((tuple(int(i) for i in a[4:].split(",")) for a in sys.argv[5:] if a.startswith("tie=")), ())
    bf16 = "bf16" in sys.argv[5:]
    fp16 = next((int(a.split("=", 1)[1]) for a in sys.argv[5:] if a.startswith("fp16=")), None)
    cast = torch.autocast("cpu", dtype=torch.float16 if fp16 is not None else torch.bfloat16,
                          enabled=bf16 or fp16 is not None)
    scaler = {"scale": 2.0 ** fp16, "skipped": 0} if fp16 is not None else None
    from hethub.partitioner import load_plan
    plan = load_plan(plan_path)
    layers = make_layers(plan.model.num_planner_layers, tie=tie)
    mb, M, lr = plan.micro_batch_size, plan.num_micro_batches, 0.1
    losses, trace, weight_casts = [], "", []  # weight_casts: [bf16 casts, distinct weights cast] per step
    if single:
        model = nn.Sequential(*layers)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(steps):
            losses.append(reference_step(model, opt, [micro_batch(step, m, mb) for m in range(M)], loss_fn, clip,
                                         cast, scaler))
        with torch.no_grad():
            with cast:
                eval_loss = sum(loss_fn(model(x), y).item() for x, y in (micro_batch(-1, m, mb) for m in range(2))) / 2
        params = {f"{i}.{k}": v for i, l in enumerate(layers) for k, v in l.state_dict().items()}
    else:
        import hethub
        config = {"gradient_clipping": clip} if clip > 0 else {}
        if bf16:
            config["bf16"] = {"enabled": True}
        if fp16 is not None:
            config["fp16"] = {"enabled": True, "initial_scale_power": fp16, "hysteresis": 1}
        if "zero1" in sys.argv[5:]:  # optimizer state sharded over each stage's replicas (hethub.zero)
            config["zero_optimization"] = {"stage": 1}
        # buckets of 1 KiB: a stage's all-reduce runs as several, started during the last backward
        config["hetero"] = {"bucket_mb": 0.001}
        for arg in sys.argv[5:]:
            if arg.startswith("schedule="):  # a hand-edited schedule file
                config["hetero"]["schedule"] = arg.split("=", 1)[1]
            if arg.startswith("bucket_mb="):
                config["hetero"]["bucket_mb"] = float(arg.split("=", 1)[1])
        import hethub.runtime.transport as transport
        wire, pack_devices, plain_pack = set(), set(), transport.pack

        def recorded_pack(x, ranges, dtype=None):  # the dtypes boundary buffers cross in, and where they are packed
            buf = plain_pack(x, ranges, dtype)
            wire.add(str(buf.dtype))
            pack_devices.add(buf.device.type)
            return buf
        transport.pack = recorded_pack
        engine, _, _, _ = hethub.initialize(layers=layers, loss_fn=loss_fn, config=config, plan=plan,
                                            optimizer=lambda ps: torch.optim.SGD(ps, lr=lr))
        # runs of the stage's first layer while training (twice per micro-batch under recompute), counted in its
        # forward itself: checkpointing's second run does not call forward hooks
        forwards, first_layer = [0], engine.module.forward_funcs[0]
        plain_forward = first_layer.forward

        def counted(*args, **kw):
            forwards[0] += 1
            return plain_forward(*args, **kw)
        first_layer.forward = counted
        beat = os.environ.get("HEARTBEAT")  # fault tests: rank 0 prints each finished step
        fail_rank, _, fail_step = os.environ.get("FAIL_AT", "-1:-1").partition(":")  # a user's bug, on one rank
        for step in range(steps):
            if engine.global_rank == int(fail_rank) and step == int(fail_step):
                def bug(*_):
                    raise RuntimeError("user bug in a layer (mentions a timeout and a peer, yet is no lost peer)")
                engine.module.forward_funcs[0].register_forward_hook(bug)
            it = iter([micro_batch(step, m, mb) for m in range(M)])
            with (WeightCasts(engine.module.parameters()) if bf16 else contextlib.nullcontext()) as casts:
                losses.append(float(engine.train_batch(it)))
            if bf16:
                weight_casts.append(casts.counts())
            if beat and engine.global_rank == 0:
                print(f"step {step}", flush=True)
        trace = " ".join(engine.executed)  # what the last train_batch ran, action by action
        first_layer.forward = plain_forward
        eval_loss = float(engine.eval_batch(iter([micro_batch(-1, m, mb) for m in range(2)]), num_micro_batches=2))
        if fp16 is not None:
            scaler = {"scale": engine.loss_scaler.cur_scale, "skipped": engine.skipped_steps}
        mine = [i for a, b in engine.grid.stage.chunk_ranges for i in range(a, b)]  # every chunk's layers
        params = {f"{i}.{k}": v for i in mine for k, v in layers[i].state_dict().items()}
    if os.environ.get("END_SLEEP_RANK0") and os.environ.get("RANK") == "0":
        import time
        time.sleep(float(os.environ["END_SLEEP_RANK0"]))  # rank 0 does extra work after training
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64), "params": params,
                "eval_loss": torch.tensor(eval_loss, dtype=torch.float64), "trace": trace,
                "forwards": 0 if single else forwards[0], "weight_casts": weight_casts,
                "wire": [] if single else sorted(wire),
                "param_devices": [] if single else sorted({p.device.type for p in engine.module.parameters()}),
                "pack_devices": [] if single else sorted(pack_devices), "loss_scale": scaler["scale"] if scaler else 0.0, "skipped": scaler["skipped"] if scaler else 0,
                "device_type": "" if single else engine.grid.device_type,
                "sends_held": 0 if single else max(engine.transport.peak_sends.values(), default=0),
                "stage_bridge": False if single else engine.grid.dp_bridged,
                "world_backend": "" if single else dist.get_backend(),
                "groups": [] if single else [[s.purpose, list(s.ranks), s.backend] for s in engine.grid.specs]},
               out_path)


if __name__ == "__main__":
    main()
