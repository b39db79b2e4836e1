"""The prepared device check: run on a machine with one NVIDIA GPU and no network, in at most 540 s.

    python benchmarks/gpu_check.py [--out DIR]      # writes DIR/gpu.md (default: benchmarks/results)

1. the GPU test tier (``tests/test_gpu.py``): compiled kernels bit-exact against the reference, a one-rank NCCL
   ``initialize -> train_batch -> save/load``;
2. pack/unpack GB/s against the same bytes copied by ``Tensor.copy_`` on the device (CUDA events, median of 20);
3. three ranks on the one GPU, each a fresh interpreter with the CUDA accelerator, each its own vendor and host, so
   every boundary and the world go through the gloo host bridge (the cross-vendor path), trained against one
   process (losses and weights), each rank reporting where its parameters and boundary buffers lived;
4. what the machine is.

Each part ends PASS, FAIL or SKIP with why, and runs under what is left of the 540-s budget; a skipped part is
never a pass: the check exits 0 only when every part passed. Without a GPU it prints one line and exits 2.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
BUDGET_S = 540.0  # a device command gets at most 600 s: the rest is start-up and copying results back
_DEADLINE = [0.0]


def _left_s(cap: float) -> float:
    """Seconds a part may take: its own cap, or what is left of the budget."""
    return max(1.0, min(cap, _DEADLINE[0] - time.monotonic()))


def _events_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn`` on the device, by CUDA events (after 3 warm-ups)."""
    import torch
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


def test_tier() -> tuple[str, list[str]]:
    """The gpu-marked tests, compiled (no interpreter): PASS only if some ran and none was skipped."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HETHUB_REQUIRE_GPU"] = "1"  # conftest: never fall back to the Triton interpreter
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/test_gpu.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=_left_s(220), env=env)
    lines = r.stdout.strip().splitlines() or ["(no output)"]
    tail = lines[-1]
    details = [f"  - `{line[:200]}`" for line in lines if line.startswith(("FAILED", "ERROR", "SKIPPED"))]
    if r.returncode != 0:
        return "FAIL", [f"- GPU test tier: FAIL ({tail})", *details]
    if "skipped" in tail or " passed" not in tail:
        return "SKIP", [f"- GPU test tier: SKIP, tests did not run ({tail})", *details]
    return "PASS", [f"- GPU test tier: PASS ({tail})"]


def bandwidth() -> tuple[str, list[str]]:
    import torch
    from hethub.kernels import pack, unpack
    out, worst = [], float("inf")
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
        worst = min(worst, gbps(moved, t_pack) / ref, gbps(moved, t_unpack) / ref)
    return ("PASS" if worst >= 0.8 else "FAIL"), out


def bridge_run() -> tuple[str, list[str]]:
    """Three ranks on the one GPU over the host bridge against one process (tests/plans.run_and_compare). Each
    rank is a fresh interpreter (a fork server that imported DeepSpeed under another accelerator would train on
    the CPU) and reports the devices its parameters and packed boundary buffers lived on."""
    import json as _json
    import torch
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
    env = {"DS_ACCELERATOR": "cuda", "HETHUB_DEVICE_TYPE": "GPU-nvidia-amd-intel", "HETHUB_TEST_EXEC": "1"}
    os.environ["HETHUB_TEST_EXEC"] = "1"  # spawn: fresh interpreters, never the CPU-preloaded fork server
    results = spawn(3, [WORKER, path, os.path.join(tmp, "rank{rank}.pt"), str(STEPS), str(CLIP)],
                    timeout=_left_s(180), extra_env=env)
    bad = [f"rank {r}: {err.strip().splitlines()[-1][:200] if err.strip() else rc}"
           for r, (rc, _o, err) in enumerate(results) if rc != 0]
    if bad:
        return "FAIL", ["- three ranks over the host bridge: FAIL", *[f"  - {b}" for b in bad]]

    class _P:  # tmp_path for single_process
        def __truediv__(self, name):
            return os.path.join(tmp, name)
    ref = single_process(_P(), path)
    worst, where, on_gpu = 0.0, [], True
    for r in range(3):
        got = torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True)
        worst = max(worst, float(((got["losses"] - ref["losses"]).abs() / ref["losses"].abs()).max()))
        where.append(f"rank {r}: parameters on {got['param_devices']}, packed buffers on {got['pack_devices']}")
        on_gpu = on_gpu and got["param_devices"] == ["cuda"] and got["pack_devices"] == ["cuda"]
    verdict = "PASS" if worst <= 1e-5 and on_gpu else "FAIL"
    return verdict, [f"- three ranks on one GPU over the host bridge vs one process: {verdict} (worst relative loss "
                     f"difference {worst:.2e} over {STEPS} steps, target 1e-5; every tensor on cuda: {on_gpu})",
                     *[f"  - {w}" for w in where]]


def machine() -> tuple[str, list[str]]:
    import torch
    props = torch.cuda.get_device_properties(0)
    return "PASS", [f"- {props.name}, {props.total_memory / 2 ** 30:.0f} GiB, capability {props.major}.{props.minor}; "
                    f"torch {torch.__version__}, CUDA {torch.version.cuda}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="the prepared device check (one GPU, at most 540 s)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"),
                        help="folder gpu.md is written to (default: benchmarks/results)")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no GPU is present (torch.cuda.is_available() is False): nothing was checked",
              file=sys.stderr)
        return 2
    _DEADLINE[0] = time.monotonic() + BUDGET_S
    os.environ.pop("TRITON_INTERPRET", None)
    lines = ["# GPU check (benchmarks/gpu_check.py)", "", "One run on one machine.", ""]
    verdicts = []
    for title, part in (("Machine", machine), ("Test tier", test_tier), ("Pack/unpack bandwidth", bandwidth),
                        ("Cross-vendor path on one GPU", bridge_run)):
        if time.monotonic() >= _DEADLINE[0]:
            verdict, got = "SKIP", [f"- SKIP: the {BUDGET_S:.0f}-s budget was spent before this part"]
        else:
            try:
                verdict, got = part()
            except subprocess.TimeoutExpired as exc:
                verdict, got = "FAIL", [f"- FAIL: timed out after {exc.timeout:.0f} s"]
            except Exception as exc:  # noqa: BLE001 - a part reports its own failure and the next one still runs
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                verdict, got = "FAIL", [f"- FAIL: {type(exc).__name__}: {first}"]
        verdicts.append(verdict)
        lines += [f"## {title}: {verdict}", "", *got, ""]
        print(f"{title}: {verdict}", *got, sep="\n", flush=True)
    os.makedirs(args.out, exist_ok=True)
    result = os.path.join(args.out, "gpu.md")
    tmp = result + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(tmp, result)
    print(json.dumps({"wrote": result, "verdicts": verdicts}))
    return 0 if all(v == "PASS" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
