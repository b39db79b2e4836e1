"""Tensor parallelism on the emulated 2-type cluster, one run, numbers side by side:

(a) layer time at t = 2 (2 processes, gloo), forward + backward of one block:
    - hethub's GPT block split by hethub (``hethub.tp.parallelize``, what ``hethub.initialize`` does) vs the
      same block split by a hand-written ``parallelize_module`` call;
    - a megatron-core block split by hethub (``split_tensor_parallel``: rebuilt over a group) vs the same
      layer built by megatron-core itself under ``initialize_model_parallel(tensor_model_parallel_size=2)``;
(b) a plan with a t = 2 stage (FAST x1 -> SLOW t=2 x1): measured iteration vs predicted, with the t = 2
    profile measured by ``hethub profile --tensor-parallel 2`` and with the analytic terms on top of t = 1.
Median of the iterations after warm-up. Writes benchmarks/results/tensor_parallel.md.
Run: python benchmarks/tensor_parallel.py [--steps N]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from runtime import FID_CLUSTER, FID_FAST, FID_MODEL, FID_SLOW, run, write_result  # noqa: E402

from hethub.partitioner import Cluster, ModelConfig, load_profile  # noqa: E402
from hethub.partitioner.costmodel import CostModel  # noqa: E402
from hethub.partitioner.evaluate import predict  # noqa: E402
from hethub.partitioner.placement import StageLayout, build_plan  # noqa: E402
from hethub.cli.profiler import profile_model  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)


def torchrun(n: int, args: list[str], port: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(port),
           *args]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(args[:3])}):\n" + (r.stdout + r.stderr)[-3000:])
    return r.stdout


def _time_ms(module, make_input, reps: int) -> float:
    """Median forward + backward milliseconds; every rank runs the same count (collectives inside)."""
    import time
    times = []
    for i in range(reps + 3):
        x = make_input()
        t0 = time.perf_counter()
        module(x).sum().backward()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def layer_worker(out: str, reps: int) -> None:
    """Under torchrun with 2 processes: (a)'s four layer times, interleaved run by run."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hethub.runtime import tp
    from hethub.models.megatron import MegatronBlock, cpu_compat
    from hethub.models.builtin import Block
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    model = ModelConfig.model_validate(FID_MODEL)
    b, s, h = 4, model.seq_length, model.hidden_size
    make = lambda: torch.randn(b, s, h, requires_grad=True)  # noqa: E731
    torch.manual_seed(0)
    ours, plain = Block(model), Block(model)
    tp.parallelize(1, [ours], {}, mesh)
    parallelize_module(plain, mesh, {path: ColwiseParallel() if style == "colwise" else RowwiseParallel()
                                     for path, style in Block.TP_PLAN.items()
                                     if path in dict(plain.named_modules())})
    # megatron-core: hethub's per-group rebuild vs megatron-core's own TP = 2 over the world
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = dict(num_layers=1, hidden_size=h, num_attention_heads=model.num_attention_heads,
               ffn_hidden_size=model.ffn_hidden_size, use_cpu_initialization=True, hidden_dropout=0.0,
               attention_dropout=0.0)
    cpu_compat()
    m_ours = MegatronBlock(TransformerConfig(**cfg), 1)
    m_ours.split_tensor_parallel(mesh.get_group())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    cpu_compat()
    m_plain = MegatronBlock(TransformerConfig(**cfg, tensor_model_parallel_size=2), 1)
    result = {name: [] for name in ("hethub_block", "plain_block", "hethub_megatron", "megatron_tp2")}
    for _ in range(3):  # interleaved rounds, so drift hits all four alike
        for name, mod in (("hethub_block", ours), ("plain_block", plain), ("hethub_megatron", m_ours),
                          ("megatron_tp2", m_plain)):
            result[name].append(_time_ms(mod, make, reps))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({k: statistics.median(v) for k, v in result.items()}, f)
    dist.destroy_process_group()


def main():
    if "--layer-worker" in sys.argv:
        layer_worker(sys.argv[sys.argv.index("--layer-worker") + 1], 15)
        return
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 12
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="hethub-bench-tp-")
    out = os.path.join(tmp, "layers.json")
    torchrun(2, [os.path.abspath(__file__), "--layer-worker", out], 29731)
    with open(out) as f:
        lt = json.load(f)

    cluster, model = Cluster.model_validate(FID_CLUSTER), ModelConfig.model_validate(FID_MODEL)
    model_json = os.path.join(tmp, "model.json")
    with open(model_json, "w") as f:
        f.write(model.to_json())
    whole = [profile_model(model, t, mb, "fp32", reps=5, slowdown=k, progress=False)
             for t, k in (("FAST", FID_FAST), ("SLOW", FID_SLOW)) for mb in (1, 2, 4)]
    split = []
    for mb in (1, 2, 4):
        path = os.path.join(tmp, f"slow-tp2-mb{mb}.json")
        torchrun(2, ["-m", "hethub.cli", "profile", "--model", model_json, "--device-type", "SLOW", "--dtype", "fp32",
                     "--micro-batch-size", str(mb), "--reps", "5", "--emulate-slowdown", f"{FID_SLOW:g}",
                     "--tensor-parallel", "2", "-o", path], 29732 + mb)
        split.append(load_profile(path))
    cm_measured = CostModel(cluster, model, dtype="fp32", profiles=whole + split, memory_reserve_gib=0.5)
    cm_analytic = CostModel(cluster, model, dtype="fp32", profiles=whole, memory_reserve_gib=0.5)
    b, M = 4, 8
    plan = build_plan(model, cluster, [StageLayout((0, 8), "FAST", (4,)),
                                       StageLayout((8, 12), "SLOW", (4,), tensor_parallel=2)], b, M)
    path = os.path.join(tmp, "plan.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    measured = run(plan.world_size, ["--mode", "hethub", "--hetero-plan", path, "--model-json", model_json,
                                     "--emulate", f"FAST={FID_FAST:g},SLOW={FID_SLOW:g}", "--steps", str(steps)],
                   os.path.join(tmp, "tp-out.json"), 29741)
    pred_m, pred_a = predict(plan, cm_measured).iteration_s, predict(plan, cm_analytic).iteration_s
    blk_m = sum(cm_measured.stage_compute_s("SLOW", 8, 9, 4, tp=2))
    blk_1 = sum(cm_measured.stage_compute_s("SLOW", 8, 9, 4))
    rows = [
        f"| (a) hethub GPT block split by hethub vs hand-written `parallelize_module` | {lt['hethub_block']:.2f} ms vs "
        f"{lt['plain_block']:.2f} ms | {lt['hethub_block'] / lt['plain_block'] - 1:+.1%} | within 10% |",
        f"| (a) megatron-core block split by hethub vs megatron-core's own TP = 2 | {lt['hethub_megatron']:.2f} ms vs "
        f"{lt['megatron_tp2']:.2f} ms | {lt['hethub_megatron'] / lt['megatron_tp2'] - 1:+.1%} | within 10% |",
        f"| (b) plan with a t = 2 stage: predicted (t = 2 profile) vs measured | {pred_m * 1e3:.0f} ms vs "
        f"{measured * 1e3:.0f} ms | {pred_m / measured - 1:+.1%} | within 10% |",
        f"| (b') same, t = 2 priced analytically on the t = 1 profile | {pred_a * 1e3:.0f} ms vs {measured * 1e3:.0f} ms "
        f"| {pred_a / measured - 1:+.1%} | |",
    ]
    text = "\n".join([
        "# Tensor parallelism (emulated 2-type cluster on this 2-core CPU machine, gloo)", "",
        f"(a) one block of {model.name} (hidden {model.hidden_size}, seq {model.seq_length}, micro-batch 4), "
        "forward + backward at t = 2, median of 3 interleaved rounds of 15. (b) model "
        f"{model.name} ({model.num_layers} blocks); plan FAST x1 layers [0,8) -> SLOW t=2 x1 layers [8,12), "
        f"micro-batch {b} x {M}; FAST emulated {FID_FAST:g}x slower than this CPU, SLOW {FID_SLOW:g}x; median of "
        f"{steps - 3} iterations after 3 warm-up, Adam. The SLOW block at micro-batch 4: {blk_1 * 1e3:.0f} ms "
        f"whole, {blk_m * 1e3:.0f} ms measured split over 2 (gloo all-reduces on 2 shared cores).", "",
        "| comparison | times | result | target |", "|---|---|---|---|", *rows, ""])
    write_result("tensor_parallel.md", text)


if __name__ == "__main__":
    main()
