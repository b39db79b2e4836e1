"""Checkpoints survive a re-plan: save under plan A, load under plan B (other cuts, widths, world size)."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from dist_util import spawn
from test_runtime import stack_plan

pytest.importorskip("deepspeed")
WORKER = os.path.join("tests", "workers", "resume.py")
PLAN_A = ([3], [[3, 3], [2, 2, 2]], 6, 2)          # 2 -> 3, 5 ranks
PLAN_B = ([2, 5], [[6], [4, 2], [6]], 6, 2)         # 1 -> 2 -> 1, 4 ranks
K = 3


def _write(tmp_path, name, plan):
    path = str(tmp_path / f"{name}.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    return path


def _ok(results):
    for rank, (rc, _out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"


@pytest.mark.parametrize("opt,clip", [("sgd", 0.05), ("adam", 0.0)])
def test_resume_under_another_plan_equals_an_uninterrupted_run(tmp_path, opt, clip):
    a, b = stack_plan(*PLAN_A), stack_plan(*PLAN_B)
    pa, pb = _write(tmp_path, "a", a), _write(tmp_path, "b", b)
    ckpt = str(tmp_path / "ckpt")
    _ok(spawn(a.world_size, [WORKER, pa, str(tmp_path / "a{rank}.pt"), "0", str(K), opt, str(clip), "--save", ckpt]))
    assert open(os.path.join(ckpt, "latest")).read() == f"global_step{K}"
    _ok(spawn(b.world_size, [WORKER, pb, str(tmp_path / "b{rank}.pt"), str(K), str(2 * K), opt, str(clip),
                             "--load", ckpt]))
    r = subprocess.run([sys.executable, WORKER, "single", str(tmp_path / "ref.pt"), "0", str(2 * K), opt, str(clip)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ref = torch.load(str(tmp_path / "ref.pt"), weights_only=True)
    first = torch.load(str(tmp_path / "a0.pt"), weights_only=True)
    torch.testing.assert_close(first["losses"], ref["losses"][:K], rtol=1e-6, atol=0)
    seen = set()
    for rank in range(b.world_size):
        got = torch.load(str(tmp_path / f"b{rank}.pt"), weights_only=True)
        torch.testing.assert_close(got["losses"], ref["losses"][K:], rtol=1e-6, atol=0)
        for k, v in got["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=1e-6, atol=1e-7)
            seen.add(k)
    assert seen == set(ref["params"])


def test_bad_checkpoints_are_refused_with_a_reason(tmp_path):
    from hethub.checkpoint import resolve_tag
    from hethub.partitioner import InputError
    a = stack_plan(*PLAN_A)
    pa = _write(tmp_path, "a", a)
    ckpt = tmp_path / "ckpt"
    _ok(spawn(a.world_size, [WORKER, pa, str(tmp_path / "a{rank}.pt"), "0", "1", "sgd", "0", "--save", str(ckpt)]))
    # a missing `latest` falls back to the newest complete checkpoint, and says so
    os.remove(ckpt / "latest")
    said = []
    assert resolve_tag(str(ckpt), None, said.append) == "global_step1"
    assert "no " in said[0] and "newest complete checkpoint 'global_step1'" in said[0]
    # an interrupted save (a .tmp directory) is ignored
    (ckpt / ".tmp-global_step2").mkdir()
    assert resolve_tag(str(ckpt), None, said.append) == "global_step1"
    # a truncated layer file is refused with its path
    layer = ckpt / "global_step1" / "layer_04-model_states.pt"
    layer.write_bytes(layer.read_bytes()[:20])
    results = spawn(a.world_size, [WORKER, pa, str(tmp_path / "c{rank}.pt"), "1", "2", "sgd", "0", "--load",
                                   str(ckpt)], timeout=90)
    assert all(rc == 2 for rc, _, _ in results)  # every rank ends, none hangs
    errs = [e.strip().splitlines()[-1] for _, _, e in results]
    assert any("layer_04-model_states.pt is truncated or corrupt" in e for e in errs)
    assert all(e.startswith("error: checkpoint") for e in errs)
    with pytest.raises(InputError, match="no complete checkpoint"):
        resolve_tag(str(tmp_path / "nowhere"), None)


def test_checkpoint_of_another_model_shape_names_layer_and_shapes(tmp_path):
    a = stack_plan(*PLAN_A)
    pa = _write(tmp_path, "a", a)
    ckpt = tmp_path / "ckpt"
    _ok(spawn(a.world_size, [WORKER, pa, str(tmp_path / "a{rank}.pt"), "0", "1", "sgd", "0", "--save", str(ckpt)]))
    layer = ckpt / "global_step1" / "layer_02-model_states.pt"
    state = torch.load(layer, weights_only=True)
    state["0.weight"] = torch.zeros(5, 12)
    torch.save(state, layer)
    results = spawn(a.world_size, [WORKER, pa, str(tmp_path / "c{rank}.pt"), "1", "2", "sgd", "0", "--load",
                                   str(ckpt)], timeout=90)
    errs = "".join(e for _, _, e in results)
    assert all(rc == 2 for rc, _, _ in results)
    assert "layer 2 (Sequential).0.weight: checkpoint shape (5, 12), model shape (12, 12)" in errs
