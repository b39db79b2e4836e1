"""Kernels: Triton (under TRITON_INTERPRET=1 on CPU tensors here) == plain-torch reference.

Lossless casts bit for bit (NaN positions compared as NaN: their payload is platform-defined);
fp8 within its documented bound; random shapes, ranges and dtypes; empty and single-row ranges;
non-contiguous inputs; bad input raises ValueError naming the range.
"""
import os
import random

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported by the kernels
triton = pytest.importorskip("triton")

from hethub.kernels import pack, pack_reference, unpack, unpack_reference  # noqa: E402
from hethub.kernels.pack import FP8  # noqa: E402

BACKEND = "triton"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    if not torch.equal(na, nb):
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.view(view)[~na], b.view(view)[~nb])


def random_ranges(rng: random.Random, rows: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(rows + 1), k=min(rows + 1, rng.randint(2, 6))))
    spans = [(a, b) for a, b in zip(cuts, cuts[1:])]
    rng.shuffle(spans)
    spans = spans[:rng.randint(1, len(spans))]
    if rng.random() < 0.3:
        spans.append((cuts[0], cuts[0]))  # an empty range
    return spans


@pytest.mark.parametrize("seed", range(25))
def test_lossless_pack_unpack_bit_exact(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows = rng.randint(1, 9)
    shape = (rows, *[rng.randint(1, 7) for _ in range(rng.randint(0, 2))], rng.randint(1, 70))
    src = rng.choice(DTYPES)
    x = (torch.randn(shape, generator=g) * rng.choice([1e-3, 1.0, 1e3])).to(src)
    flat = x.view(-1)
    if flat.numel() > 3:  # specials: NaN, inf, a value that rounds up to inf in bf16, a subnormal
        flat[0], flat[1], flat[2] = float("nan"), float("inf"), 1e-41 if src == torch.float32 else 0.0
    wire = rng.choice([None] + [d for d in DTYPES if d != torch.float32 or src == torch.float32])
    ranges = random_ranges(rng, rows)
    a = pack(x, ranges, wire, backend=BACKEND)
    b = pack_reference(x, ranges, wire)
    assert same_bits(a, b), (src, wire, ranges)
    out_dtype = rng.choice(DTYPES)
    oa = torch.zeros(shape, dtype=out_dtype)
    ob = torch.zeros(shape, dtype=out_dtype)
    unpack(a, oa, ranges, backend=BACKEND)
    unpack_reference(b, ob, ranges)
    assert same_bits(oa, ob)
    # round trip through an fp32 wire is the identity on the selected rows
    if wire in (None, torch.float32) and out_dtype == src:
        for s, e in ranges:
            assert same_bits(oa[s:e], x[s:e])


def test_fp8_within_documented_bound_and_matches_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 48, generator=g) * torch.logspace(-3, 3, 48)
    ranges = [(1, 3), (5, 6), (0, 1)]
    a = pack(x, ranges, FP8, backend=BACKEND)
    b = pack_reference(x, ranges, FP8)
    assert torch.equal(a, b)
    out = torch.zeros_like(x)
    unpack(a, out, ranges, backend=BACKEND)
    for s, e in ranges:
        ref = x[s:e]
        scale = ref.abs().amax(dim=-1, keepdim=True) / 448
        err = (out[s:e] - ref).abs()
        bound = 2 ** -4 * ref.abs() + 2 ** -10 * scale
        assert (err <= bound * (1 + 1e-6)).all()
    assert out[1:3].abs().sum() > 0 and torch.equal(out[3:5], torch.zeros_like(out[3:5]))


def test_empty_and_single_row_ranges():
    x = torch.randn(4, 8)
    assert pack(x, [], backend=BACKEND).shape == (0, 8)
    assert pack(x, [(2, 2)], backend=BACKEND).shape == (0, 8)
    one = pack(x, [(3, 4)], torch.bfloat16, backend=BACKEND)
    assert same_bits(one, x[3:4].to(torch.bfloat16))


def test_non_contiguous_input_is_handled():
    x = torch.randn(8, 6).t()  # [6, 8] with stride (1, 6)
    assert not x.is_contiguous()
    assert same_bits(pack(x, [(1, 4)], torch.float16, backend=BACKEND), x[1:4].to(torch.float16))
    out = torch.zeros(8, 6).t()
    unpack(pack(x, [(0, 6)], backend=BACKEND), out, [(0, 6)], backend=BACKEND)
    assert torch.equal(out, x)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_input_names_the_range(backend):
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"ranges\[1\]: \[3, 6\) is outside the tensor's rows \[0, 4\)"):
        pack(x, [(0, 1), (3, 6)], backend=backend)
    with pytest.raises(ValueError, match=r"ranges\[1\]: \[1, 3\) overlaps ranges\[0\] \[0, 2\)"):
        pack(x, [(0, 2), (1, 3)], backend=backend)
    with pytest.raises(ValueError, match="x: dtype torch.int64 cannot be packed"):
        pack(torch.ones(4, 3, dtype=torch.int64), [(0, 1)], backend=backend)
    with pytest.raises(ValueError, match="buf: shape"):
        unpack(torch.zeros(2, 3), torch.zeros(4, 3), [(0, 3)], backend=backend)


def test_dispatch_uses_the_reference_for_cpu_tensors(monkeypatch):
    import sys
    kp = sys.modules["hethub.kernels.pack"]  # the attribute hethub.kernels.pack is the function
    called = []
    monkeypatch.setattr(kp, "pack_reference", lambda *a, **k: called.append("ref") or torch.zeros(0))
    kp.pack(torch.randn(2, 2), [(0, 1)])
    assert called == ["ref"]


def test_a_failing_triton_kernel_falls_back_to_the_reference_once_with_one_line(monkeypatch, capsys):
    """A compile or launch failure (no C compiler for Triton's launcher, an unsupported type) must not end a
    transfer: the reference gives the same bytes; the failure is said once, then Triton is left alone."""
    import sys
    kp = sys.modules["hethub.kernels.pack"]
    tp = pytest.importorskip("hethub.kernels.triton_pack")
    monkeypatch.setattr(kp, "_BROKEN", [])
    monkeypatch.setattr(kp, "_use_triton", lambda t, backend, fp8: not kp._BROKEN)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("triton launcher: no C compiler found\nmore")
    monkeypatch.setattr(tp, "pack_triton", broken)
    x = torch.randn(6, 3, 8)
    got = kp.pack(x, [(1, 3), (4, 6)], torch.bfloat16)
    assert torch.equal(got, kp.pack_reference(x, [(1, 3), (4, 6)], torch.bfloat16))
    again = kp.pack(x, [(0, 2)])
    assert torch.equal(again, x[0:2]) and calls == [1]  # given up after the first failure
    err = capsys.readouterr().err.splitlines()
    assert err == ["hethub: the Triton pack/unpack kernels failed (RuntimeError: triton launcher: no C compiler "
                   "found); using the torch reference from now on"]


def test_bad_ranges_stay_the_callers_error_with_the_fallback(monkeypatch):
    import sys
    kp = sys.modules["hethub.kernels.pack"]
    monkeypatch.setattr(kp, "_use_triton", lambda t, backend, fp8: True)
    with pytest.raises(ValueError, match=r"ranges\[0\]"):
        kp.pack(torch.randn(2, 2), [(0, 5)])


def test_fp8_is_never_compiled_for_a_device_without_e4m3(monkeypatch):
    import sys
    kp = sys.modules["hethub.kernels.pack"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kp.fp8_supported(torch.zeros(1))  # a CPU tensor outside the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kp.fp8_supported(torch.zeros(1))


def test_rows_wider_than_cudas_second_grid_axis_pack_in_one_launch_per_range():
    """8192 x 8192 elements per row needed 65,536 column blocks on grid axis 1 (CUDA's limit: 65,535); the
    blocks now run on axis 0. Under the interpreter a smaller row checks the flattened indexing."""
    pytest.importorskip("triton")
    from hethub.kernels.triton_pack import BLOCK, pack_triton, unpack_triton
    x = torch.randn(5, 3 * BLOCK + 7)
    ranges = [(3, 5), (0, 1)]
    buf = pack_triton(x, ranges, torch.float16)
    assert torch.equal(buf, pack_reference(x, ranges, torch.float16))
    out = torch.zeros_like(x)
    unpack_triton(buf, out, ranges)
    assert torch.equal(out, unpack_reference(buf, torch.zeros_like(x), ranges))
