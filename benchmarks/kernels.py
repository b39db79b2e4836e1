"""Kernel benchmark (CUDA/ROCm only): GB/s of Triton pack+unpack vs the torch reference vs the device's
memory bandwidth, for activation sizes of real models. Writes benchmarks/results/kernels.md.

Run on a GPU machine: python benchmarks/kernels.py [--peak-gbps 4800]
GB/s counts bytes read + bytes written by the pair (pack: read x rows, write buffer; unpack: read buffer,
write out rows). The reference is index/cat/to (kernels.pack_reference / unpack_reference).
"""
import os
import sys

import torch

from hethub.kernels import pack, unpack
from hethub.kernels.pack import FP8, pack_reference, unpack_reference

SHAPES = [  # (micro-batch, seq, hidden)
    (1, 2048, 4096), (4, 2048, 4096), (8, 2048, 4096),
    (2, 4096, 8192), (1, 8192, 8192), (2, 4096, 12288),
]


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3  # s


def main():
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA/ROCm device")
    peak = float(sys.argv[sys.argv.index("--peak-gbps") + 1]) if "--peak-gbps" in sys.argv else None
    name = torch.cuda.get_device_name()
    rows = []
    for b, s, h in SHAPES:
        x = torch.randn(b * 2, s, h, device="cuda", dtype=torch.bfloat16)  # two peers' rows
        ranges = [(1, 1 + b // 2 + 1), (b + 1, 2 * b)] if b > 1 else [(0, 1)]
        n = sum(e - a for a, e in ranges)
        for wire in (None, torch.float16, FP8):
            out = torch.empty_like(x)
            buf = pack(x, ranges, wire)
            wire_bytes = buf.numel() * buf.element_size()
            moved = 2 * (n * s * h * x.element_size() + wire_bytes)
            t_tri = bench(lambda: unpack(pack(x, ranges, wire), out, ranges))
            t_ref = bench(lambda: unpack_reference(pack_reference(x, ranges, wire), out, ranges))
            eff = f"{moved / t_tri / 1e9 / peak:.0%}" if peak else "n/a"
            rows.append(f"| {b}x{s}x{h} bf16 | {str(wire).replace('torch.', '') if wire else 'bf16'} | "
                        f"{moved / t_tri / 1e9:.0f} | {moved / t_ref / 1e9:.0f} | {t_ref / t_tri:.2f}x | {eff} |")
            print(rows[-1], flush=True)
    text = "\n".join([f"# pack+unpack on {name}", "",
                      "| activation | wire | Triton GB/s | reference GB/s | speed-up | of peak |",
                      "|---|---|---|---|---|---|", *rows, ""])
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/kernels.md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
