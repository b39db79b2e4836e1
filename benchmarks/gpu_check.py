"""The prepared device check: run on a machine with one NVIDIA GPU and no network, in a few minutes.

    python benchmarks/gpu_check.py            # writes benchmarks/results/gpu.md

1. the GPU test tier (``tests/test_gpu.py``): compiled kernels bit-exact against the reference, a one-rank NCCL
   ``initialize -> train_batch -> save/load``;
2. pack/unpack GB/s against the same bytes copied by ``Tensor.copy_`` on the device (CUDA events, median of 20);
3. three ranks on the one GPU, each its own vendor and host, so every boundary and the world go through the gloo
   host bridge (the cross-vendor path), trained against one process (losses and weights);
4. what the machine is.
Each part records PASS/FAIL with its evidence rather than stopping at the first failure.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
RESULTS = os.path.join(ROOT, "benchmarks", "results", "gpu.md")


def _events_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn`` on the device, by CUDA events (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def test_tier() -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=420)
    tail = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    return [f"- GPU test tier: {'PASS' if r.returncode == 0 else 'FAIL'} ({tail})"] + (
        [f"  - `{line[:200]}`" for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))])


def bandwidth() -> list[str]:
    from hethub.kernels import pack, unpack
    out = []
    for dtype, wire in ((torch.float32, torch.bfloat16), (torch.bfloat16, None), (torch.float32, None)):
        x = torch.randn(8, 4096, 4096, device="cuda").to(dtype)
        ranges = [(4, 8), (0, 4)]
        buf = pack(x, ranges, wire, backend="triton")
        moved = x.numel() * x.element_size() + buf.numel() * buf.element_size()  # read + write
        copy_dst, copy_src = torch.empty_like(buf), buf.clone()
        t_copy = _events_ms(lambda: copy_dst.copy_(copy_src))
        copy_moved = 2 * buf.numel() * buf.element_size()
        t_pack = _events_ms(lambda: pack(x, ranges, wire, backend="triton"))
        y = torch.empty_like(x)
        t_unpack = _events_ms(lambda: unpack(buf, y, ranges, backend="triton"))
        gbps = lambda b, ms: b / ms / 1e6  # noqa: E731
        ref = gbps(copy_moved, t_copy)
        out.append(f"- {str(dtype)[6:]} -> {str(wire or dtype)[6:]}: pack {gbps(moved, t_pack):.0f} GB/s, unpack "
                   f"{gbps(moved, t_unpack):.0f} GB/s, device copy {ref:.0f} GB/s: pack/unpack at "
                   f"{gbps(moved, t_pack) / ref:.0%} / {gbps(moved, t_unpack) / ref:.0%} of the copy (target >= 80%)")
    return out


def bridge_run() -> list[str]:
    """Three ranks on the one GPU over the host bridge against one process (tests/plans.run_and_compare)."""
    import json as _json
    from hethub.partitioner import Cluster, ModelConfig, Plan
    from hethub.partitioner.placement import StageLayout, build_plan
    from plans import CLIP, STEPS, WORKER, single_process
    from dist_util import spawn
    # "GPU-<vendor>": every rank's device check passes against one HETHUB_DEVICE_TYPE naming all three
    types = {f"GPU-{v}": {"vendor": v, "peak_tflops": {"fp32": 10}, "memory_gib": 16, "memory_gbps": 500}
             for v in ("nvidia", "amd", "intel")}
    cluster = Cluster.model_validate({"name": "three-vendors", "device_types": types,
                                      "nodes": [{"host": f"h{k}", "device_type": t, "count": 1}
                                                for k, t in enumerate(types)]})
    model = ModelConfig(name="stack", architecture="gpt", num_layers=5, hidden_size=12, num_attention_heads=1,
                        ffn_hidden_size=12, vocab_size=6, seq_length=1)
    plan = build_plan(model, cluster, [StageLayout((0, 2), "GPU-nvidia", (4,)), StageLayout((2, 5), "GPU-amd", (4,)),
                                       StageLayout((5, 7), "GPU-intel", (4,))], 4, 3)
    data = _json.loads(plan.to_json())
    data["boundaries"] = [{"after_stage": 0, "transport": "host"}, {"after_stage": 1, "transport": "host"}]
    plan = Plan.model_validate(data)
    tmp = tempfile.mkdtemp(prefix="hethub-gpu-")
    path = os.path.join(tmp, "plan.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    env = {"DS_ACCELERATOR": "cuda", "HETHUB_DEVICE_TYPE": "GPU-nvidia-amd-intel"}
    results = spawn(3, [WORKER, path, os.path.join(tmp, "rank{rank}.pt"), str(STEPS), str(CLIP)], timeout=240,
                    extra_env=env)
    bad = [f"rank {r}: {err.strip().splitlines()[-1][:200] if err.strip() else rc}"
           for r, (rc, _o, err) in enumerate(results) if rc != 0]
    if bad:
        return ["- three ranks over the host bridge: FAIL", *[f"  - {b}" for b in bad]]

    class _P:  # tmp_path for single_process
        def __truediv__(self, name):
            return os.path.join(tmp, name)
    ref = single_process(_P(), path)
    worst = 0.0
    for r in range(3):
        got = torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True)
        worst = max(worst, float(((got["losses"] - ref["losses"]).abs() / ref["losses"].abs()).max()))
    verdict = "PASS" if worst <= 1e-5 else "FAIL"
    return [f"- three ranks on one GPU over the host bridge vs one process: {verdict} (worst relative loss "
            f"difference {worst:.2e} over {STEPS} steps; target 1e-5)"]


def machine() -> list[str]:
    props = torch.cuda.get_device_properties(0)
    return [f"- {props.name}, {props.total_memory / 2 ** 30:.0f} GiB, capability {props.major}.{props.minor}; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}"]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    lines = ["# GPU check (benchmarks/gpu_check.py)", "", "One run on one machine.", ""]
    for title, part in (("Machine", machine), ("Test tier", test_tier), ("Pack/unpack bandwidth", bandwidth),
                        ("Cross-vendor path on one GPU", bridge_run)):
        try:
            got = part()
        except Exception as exc:  # noqa: BLE001 - a check reports its own failure and the next one still runs
            got = [f"- FAIL: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"]
        lines += [f"## {title}", "", *got, ""]
        print("\n".join(got), flush=True)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    tmp = RESULTS + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(tmp, RESULTS)
    print(json.dumps({"wrote": RESULTS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
