"""``hethub profile``: measure per-layer forward/backward time and memory on the local device.

Every block of a model is the same module shape, so one embedding, one block and one head are
built and measured (warm-up, then the median of several repetitions); the profile lists every
planner layer so the cost model can merge it layer by layer. ``activation_bytes`` are measured
on every device through autograd's saved-tensor hooks (what backward keeps, each storage once, parameters not
at all: ``hethub.runtime.activations``); ``peak_memory_bytes``
only where the device reports it (CUDA/ROCm).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from rich.progress import Progress
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..emulated.slowdown import SlowDown, idle_to
from ..models.builtin import Block, Embedding, Head
from ..partitioner.errors import InputError
from ..partitioner.loaders import load_model
from ..partitioner.outputs import check_output_path, write_atomic
from ..runtime import split_backward
from ..runtime.activations import ActivationMeter
from ..runtime.tp import parallelize
from ..partitioner.records import LayerProfile, LinkProfile, ModelConfig, Profile, check_tensor_parallel

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Marks on the device's own timeline: CUDA events on a GPU (the stream's time between two marks, without
    the host's synchronisation round trips a perf_counter pair around ``synchronize`` adds to every short
    layer), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"

    def mark(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        if not self.events:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


def training_precision(device: torch.device, dtype: str):
    """The precision the runtime trains in: fp32 weights under an autocast to ``dtype`` (none for fp32). One
    region around every repetition, as the runtime keeps one around its iteration, so the weights' cast is
    cached after the warm-ups instead of counted in every forward; ``measure_layer`` runs backward with it off."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[dtype])


def local_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _init_ranks() -> None:
    """Start the launcher's process group with each rank on its own GPU (LOCAL_RANK), before NCCL: without it
    every rank sat on GPU 0 and NCCL saw duplicate GPUs."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def measure_layer(module: nn.Module, make_input: Callable[[], torch.Tensor], device: torch.device,
                  warmup: int = 2, reps: int = 7, agree: Callable[[int], int] = lambda n: n) -> dict:
    """Median forward and backward milliseconds of one layer, activation bytes it keeps, and peak memory.
    ``agree`` makes the ranks of a tensor-parallel group run the same number of repetitions (the largest)."""
    fwd, bwd = [], []
    peak = None
    it = 0
    target = warmup + reps
    clock = Clock(device)
    saved = _activation_bytes(module, make_input, device)  # its own pass: no hook runs inside a timed one
    while it < target:
        agree(0)  # tensor parallel: start each repetition together, so no rank's time holds another's idling
        x = make_input()
        for p in module.parameters():
            p.grad = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = clock.mark()
        y = module(x)
        t1 = clock.mark()
        with torch.autocast(device.type, enabled=False):  # backward outside autocast, as the runtime runs it
            y.backward(torch.ones_like(y))
        t2 = clock.mark()
        if it >= warmup:
            fwd.append(clock.ms(t0, t1))
            bwd.append(clock.ms(t1, t2))
            if device.type == "cuda":
                peak = int(torch.cuda.max_memory_allocated(device))
        elif it == warmup - 1:
            # Short layers get more repetitions (at least ~50 ms of measurements, at most 200): a median of
            # a handful of sub-millisecond runs moves by tens of percent between runs.
            target = agree(warmup + min(200, max(reps, int(0.05 / max(clock.ms(t0, t2) / 1e3, 1e-6)))))
        it += 1
    return {"forward_ms": statistics.median(fwd), "backward_ms": statistics.median(bwd),
            "activation_bytes": saved, "peak_memory_bytes": peak,
            "spread": spread([f + b for f, b in zip(fwd, bwd)])}


def _activation_bytes(module: nn.Module, make_input: Callable[[], torch.Tensor], device: torch.device) -> int:
    """What one forward of ``module`` leaves for its backward (``ActivationMeter``: autograd's saved-tensor hooks,
    Python per saved tensor), measured in a pass of its own so that no timed pass runs the hooks."""
    for p in module.parameters():
        p.grad = None
    meter = ActivationMeter(module.parameters())
    with meter:
        y = module(make_input())
    held = meter.held
    with torch.autocast(device.type, enabled=False):
        y.backward(torch.ones_like(y))
    return int(held)


def measure_split(module: nn.Module, make_input: Callable[[], torch.Tensor], device: torch.device,
                  warmup: int = 2, reps: int = 7, slowdown: float = 1.0) -> dict:
    """Median milliseconds of one layer's backward split as zb-h1 and zb-v run it (``runtime.split_backward``):
    the input-gradient pass, then the weight pass. Why measure rather than split ``backward_ms`` by FLOPs: each
    pass pays its own fixed costs (a CPU block's two took 1.2-1.3x its backward). Under an emulated slowdown
    the weight pass idles as the runtime's engine idles it (the layer's wrapper idles the input pass)."""
    weights = [p for p in module.parameters() if p.requires_grad]
    calls = split_backward.LinearCalls(module)
    clock, w_ref = Clock(device), {}
    inp, wgt, waiting = [], [], 0
    try:
        for it in range(-1, warmup + reps):  # -1: the untimed pass that measures what the weight pass waits with
            x = make_input()
            for p in weights:
                p.grad = None
            meter = ActivationMeter(module.parameters()) if it < 0 else contextlib.nullcontext()
            with meter:  # what the weight pass waits with: the graph kept for it, the tensors pinned for it
                with calls.capturing() as recorded:
                    y = module(x)
                with torch.autocast(device.type, enabled=False):  # backward outside autocast, as the runtime runs it
                    _sync(device)
                    t0 = clock.mark()
                    pending = split_backward.backward_input([y], [torch.ones_like(y)], [x], weights, 1, recorded)
                    t1, w0 = clock.mark(), time.perf_counter()
                    if it < 0:
                        waiting = meter.held
                    split_backward.backward_weight(weights, pending)
                    if slowdown != 1.0:
                        idle_to(slowdown, w_ref, "w", time.perf_counter() - w0)
                    t2 = clock.mark()
            if it >= warmup:
                inp.append(clock.ms(t0, t1))
                wgt.append(clock.ms(t1, t2))
    finally:
        calls.remove()
    return {"input_grad_ms": statistics.median(inp), "weight_grad_ms": statistics.median(wgt),
            "weight_pass_bytes": int(waiting)}


SPREAD_LIMIT = 0.25  # a layer whose repetitions spread wider than this (of their median) is measured again
MAX_ROUNDS = 3  # measurements of one layer at most: the first and two re-measurements


def spread(times_ms: list[float]) -> float:
    """(p90 - p10) / median of a layer's repetitions: how far one run of the profile could move."""
    ordered = sorted(times_ms)
    n = len(ordered)
    p10, p90 = ordered[int(0.1 * (n - 1))], ordered[int(round(0.9 * (n - 1)))]
    return (p90 - p10) / max(statistics.median(ordered), 1e-12)


def measure_steady(measure: Callable[[], dict], agree: Callable[[int], int] = lambda n: n) -> dict:
    """A layer measured until its spread is within SPREAD_LIMIT (at most MAX_ROUNDS times); the round with
    the least spread is kept. Why: a profile's head took 72 ms in one run and 0.3 ms in the next, and a
    planner fed the outlier puts the head on the wrong device. ``rounds`` says how often it ran."""
    best, rounds = measure(), 1
    while rounds < MAX_ROUNDS and agree(int(best["spread"] > SPREAD_LIMIT)):  # a TP group decides together
        again = measure()
        rounds += 1
        if again["spread"] < best["spread"]:
            best = again
    return {**best, "rounds": rounds}


def _tp_group(tensor_parallel: int):
    """(all-reduce-max of an int over the group, mesh) for a profile measured tensor-parallel: the world of
    processes a launcher started, which must be exactly ``tensor_parallel`` of them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tensor_parallel:
        raise InputError("--tensor-parallel", f"{tensor_parallel} needs {tensor_parallel} processes under a launcher "
                                              f"(e.g. torchrun --nproc-per-node {tensor_parallel}), got WORLD_SIZE "
                                              f"{world}")
    _init_ranks()
    mesh = init_device_mesh(local_device().type, (tensor_parallel,))

    def agree(n: int) -> int:
        t = torch.tensor([n], device=local_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    return agree, mesh


def profile_model(model: ModelConfig, device_type: str, micro_batch_size: int = 1, dtype: str = "fp32",
                  warmup: int = 2, reps: int = 7, slowdown: float = 1.0, progress: bool = True,
                  seed: int = 0, tensor_parallel: int = 1, split: bool = True) -> Profile:
    """Measure embedding, one block and head of ``model`` on the local device; every block shares the block's row.

    With ``tensor_parallel`` t > 1 (under a launcher, t processes) the block is split over them as the runtime
    splits it (``Block.TP_PLAN``), so its times include the all-reduces on this node's real link; embedding
    and head run whole, as in training. ``split``: also time the backward split in two passes (``measure_split``),
    which zb-h1 and zb-v run; without it the cost model splits the backward analytically."""
    device = local_device()
    agree, mesh = (lambda n: n), None
    if tensor_parallel > 1:
        try:
            check_tensor_parallel(model, tensor_parallel, "--tensor-parallel")
        except ValueError as exc:
            raise InputError("--tensor-parallel", str(exc).split(": ", 1)[1]) from None
        agree, mesh = _tp_group(tensor_parallel)
    torch.manual_seed(seed)
    b, s, h = micro_batch_size, model.seq_length, model.hidden_size
    # fp32 weights and an fp32 residual stream under the training dtype's autocast: what the runtime runs
    kinds: list[tuple[str, nn.Module, Callable[[], torch.Tensor]]] = [
        ("embedding", Embedding(model), lambda: torch.randint(0, model.vocab_size, (b, s), device=device)),
        ("block", Block(model), lambda: torch.randn(b, s, h, device=device, requires_grad=True)),
        ("head", Head(model), lambda: torch.randn(b, s, h, device=device, requires_grad=True)),
    ]
    rows: dict[str, dict] = {}
    bar = None
    if progress:
        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task(f"profiling {model.name} on {device_type}", total=len(kinds))
    try:
        for kind, module, make_input in kinds:
            module = module.to(device=device)
            if mesh is not None and kind == "block":
                parallelize(1, [module], {}, mesh)
            if slowdown != 1.0:
                module = SlowDown(module, slowdown)
            with training_precision(device, dtype):
                rows[kind] = measure_steady(
                    lambda: measure_layer(module, make_input, device, warmup, reps, agree), agree)
                # the embedding's token ids carry no gradient to split off; a tensor-parallel profile keeps the
                # analytic split (its passes are not measured yet)
                if split and kind != "embedding" and tensor_parallel == 1:
                    split_module = SlowDown(module.module, slowdown) if slowdown != 1.0 else module
                    rows[kind].update(measure_split(split_module, make_input, device, warmup, reps, slowdown))
            if bar:
                bar.advance(task)
    finally:
        if bar:
            bar.stop()
    return Profile(device_type=device_type, model=model, micro_batch_size=micro_batch_size, dtype=dtype,
                   emulated_slowdown=slowdown, tensor_parallel=tensor_parallel, layers=_layer_rows(model, rows),
                   host=socket.gethostname())


_MEASURED = ("forward_ms", "backward_ms", "activation_bytes", "peak_memory_bytes", "spread", "rounds",
             "input_grad_ms", "weight_grad_ms", "weight_pass_bytes")


def _layer_rows(model: ModelConfig, rows: dict[str, dict]) -> list[LayerProfile]:
    """Every planner layer's row: the measurement of its kind (each block shares the block's)."""
    return [LayerProfile(index=info.index, kind=info.kind, **{k: rows[info.kind].get(k) for k in _MEASURED})
            for info in model.layers()]


def measure_links(sizes_bytes: tuple[int, ...] = (1 << 20, 16 << 20), reps: int = 5) -> list[dict]:
    """Under a launcher: p2p bandwidth from rank 0 to every other rank, and all-reduce bandwidth of the world."""
    _init_ranks()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device()
    out = []
    nbytes = sizes_bytes[-1]
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    for peer in range(1, world):
        times = []
        for _ in range(reps):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
            elif rank == peer:
                dist.recv(buf, 0)
            _sync(device)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out.append({"src_rank": 0, "dst_rank": peer, "op": "p2p", "bytes": nbytes, "gbps": nbytes * 8 / t / 1e9})
    times = []
    for _ in range(reps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    # bus bandwidth of a ring all-reduce: 2 (w-1)/w of the buffer per rank
    out.append({"src_rank": 0, "dst_rank": world - 1, "op": "allreduce", "bytes": nbytes,
                "gbps": 2 * (world - 1) / max(world, 1) * nbytes * 8 / t / 1e9})
    return out


def cmd_profile(args: argparse.Namespace) -> int:
    """``hethub profile --model``: a model hethub describes (``--script`` is ``profile_script.cmd_profile``'s)."""
    if args.script_args:
        raise InputError("profile", f"unexpected arguments {' '.join(args.script_args)[:80]!r} (they follow -- "
                                    f"with --script only)")
    args.output = args.output or "profile.json"
    model = load_model(args.model)
    check_output_path(args.output, "--output")
    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    prof = profile_model(model, args.device_type, args.micro_batch_size, dtype, reps=args.reps,
                         slowdown=args.emulate_slowdown, progress=os.environ.get("RANK", "0") == "0",
                         tensor_parallel=args.tensor_parallel)
    if args.links:
        prof = prof.model_copy(update={"links": [LinkProfile(**d) for d in measure_links()]})
    if os.environ.get("RANK", "0") == "0":
        write_atomic(args.output, prof.to_json() + "\n", "--output")
        block = next((l for l in prof.layers if l.kind == "block"), prof.layers[0])
        tp = f", tensor parallel {prof.tensor_parallel}" if prof.tensor_parallel > 1 else ""
        for kind in ("embedding", "block", "head"):
            lp = next(l for l in prof.layers if l.kind == kind)
            again = f", measured {lp.rounds} times" if lp.rounds > 1 else ""
            wide = f" (over {SPREAD_LIMIT:.0%}: treat this layer's time with care)" if lp.spread > SPREAD_LIMIT else ""
            print(f"{kind}: forward {lp.forward_ms:.3f} ms, backward {lp.backward_ms:.3f} ms, spread "
                  f"{lp.spread:.0%}{again}{wide}")
        print(f"wrote {args.output}: {len(prof.layers)} layers of {model.name} on {args.device_type} "
              f"(micro-batch {prof.micro_batch_size}, {dtype}{tp}); block forward {block.forward_ms:.3f} ms, "
              f"backward {block.backward_ms:.3f} ms" + (f", {len(prof.links)} links" if prof.links else ""))
    return 0

