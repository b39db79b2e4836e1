"""Tier gpu: the compiled kernels and a one-rank NCCL run on a real device. Skipped without one.

``benchmarks/gpu_check.py`` runs these and measures bandwidth on a lent GPU machine; CI has no GPU.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from hethub.kernels import pack, pack_reference, unpack, unpack_reference
from hethub.kernels.pack import FP8, fp8_supported

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="needs a CUDA/ROCm device and compiled Triton kernels")]

SHAPES = [(7, 5, 33), (64, 128, 1024), (2, 8192, 8192)]  # the last: 65,536 column blocks per row


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,wire", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                        (torch.float32, torch.float16), (torch.bfloat16, None)])
def test_compiled_kernels_are_bit_exact_against_the_reference(shape, dtype, wire):
    x = torch.randn(shape, device="cuda").to(dtype)
    n = shape[0]
    ranges = [(n // 2, n), (0, n // 2)]
    buf = pack(x, ranges, wire, backend="triton")
    torch.cuda.synchronize()
    assert torch.equal(buf, pack_reference(x, ranges, wire))
    out = torch.zeros_like(x)
    unpack(buf, out, ranges, backend="triton")
    assert torch.equal(out, unpack_reference(buf, torch.zeros_like(x), ranges))


def test_fp8_runs_compiled_where_the_device_has_e4m3_and_on_the_reference_elsewhere():
    x = torch.randn(8, 16, 256, device="cuda")
    buf = pack(x, [(0, 8)], FP8)
    assert torch.equal(buf, pack_reference(x, [(0, 8)], FP8)) or not fp8_supported(x)
    out = unpack(buf, torch.zeros_like(x), [(0, 8)])
    scale = x.abs().amax(-1, keepdim=True) / 448.0
    assert bool(((out - x).abs() <= 2 ** -4 * x.abs() + 2 ** -10 * scale + 1e-12).all())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_rank_on_nccl_initializes_trains_saves_and_loads(tmp_path, precision):
    """The first GPU run of a user: hethub.initialize on NCCL, one train_batch, a checkpoint saved and loaded, in
    each training precision (fp16 with its loss scaler)."""
    config = {} if precision == "fp32" else {precision: {"enabled": True}}
    from hethub.partitioner import Cluster, ModelConfig
    from hethub.partitioner.placement import StageLayout, build_plan
    gpu = torch.cuda.get_device_name(0)
    cluster = Cluster.model_validate({
        "name": "one-gpu", "device_types": {"GPU": {"vendor": "nvidia", "peak_tflops": 100, "memory_gib": 40,
                                                    "memory_gbps": 1000}},
        "nodes": [{"host": "localhost", "device_type": "GPU", "count": 1}]})
    model = ModelConfig(name="tiny", architecture="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                        ffn_hidden_size=128, vocab_size=128, seq_length=16)
    plan = build_plan(model, cluster, [StageLayout((0, 4), "GPU", (4,))], 4, 2)
    path = str(tmp_path / "plan.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    code = f"""
import json, torch, hethub
from hethub.models.builtin import build_layers, counting_batches, lm_loss
from hethub.partitioner import ModelConfig
m = ModelConfig.model_validate_json({model.model_dump_json()!r})
engine, *_ = hethub.initialize(layers=build_layers(m), loss_fn=lm_loss, plan={path!r}, config={config!r},
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
loss = float(engine.train_batch(iter(counting_batches(0, 2, 4, m.seq_length, m.vocab_size))))
engine.save_checkpoint({str(tmp_path / "ckpt")!r})
engine.load_checkpoint({str(tmp_path / "ckpt")!r})
print(json.dumps({{"loss": loss, "backend": torch.distributed.get_backend(),
                   "device": str(next(engine.module.parameters()).device)}}))
"""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29533 + ["fp32", "bf16", "fp16"].index(precision)), "HETHUB_DEVICE_TYPE": "GPU", "PYTHONPATH": ROOT}
    env.pop("DS_ACCELERATOR", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["backend"] == "nccl" and got["device"].startswith("cuda") and got["loss"] > 0, (gpu, got)


def test_the_profilers_clock_reads_cuda_events_and_leaves_out_the_hosts_round_trips():
    """``hethub profile`` times layers with CUDA events: a matmul's event interval is positive and no longer
    than the host's perf_counter pair around the synchronisations."""
    import time
    from hethub.cli.profiler import Clock
    clock = Clock(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    h0, t0 = time.perf_counter(), clock.mark()
    for _ in range(10):
        a = a @ a / 64
    t1 = clock.mark()
    ms = clock.ms(t0, t1)
    host_ms = (time.perf_counter() - h0) * 1e3
    assert 0 < ms <= host_ms * 1.01
