"""Checkpoints survive a re-plan: save under plan A, load under plan B (other cuts, widths, world size)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from dist_util import run_python, spawn
from plans import stack_plan

pytestmark = pytest.mark.dist

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


@pytest.mark.parametrize("opt,clip", [("adam", 0.05)])  # momentum state takes the same per-parameter path
def test_resume_under_another_plan_equals_an_uninterrupted_run(tmp_path, opt, clip):
    a, b = stack_plan(*PLAN_A), stack_plan(*PLAN_B)
    pa, pb = _write(tmp_path, "a", a), _write(tmp_path, "b", b)
    ckpt = str(tmp_path / "ckpt")
    _ok(spawn(a.world_size, [WORKER, pa, str(tmp_path / "a{rank}.pt"), "0", str(K), opt, str(clip), "--save", ckpt]))
    assert open(os.path.join(ckpt, "latest")).read() == f"global_step{K}"
    _ok(spawn(b.world_size, [WORKER, pb, str(tmp_path / "b{rank}.pt"), str(K), str(2 * K), opt, str(clip),
                             "--load", ckpt]))
    r = run_python([WORKER, "single", str(tmp_path / "ref.pt"), "0", str(2 * K), opt, str(clip)], timeout=60)
    assert r.returncode == 0, r.stderr
    ref = torch.load(str(tmp_path / "ref.pt"), weights_only=True)
    first = torch.load(str(tmp_path / "a0.pt"), weights_only=True)
    # float32. The plans sum each gradient in another order than one process does (about 1e-7 relative);
    # SGD carries that through unchanged, but Adam divides by sqrt(v), so where v is tiny the same rounding
    # moves a weight by up to ~1e-3 of its lr-sized step (lr 0.01): 1e-5 abs. Measured worst: 2.5e-6 on an
    # AVX-512 machine, 6e-7 on AVX2. A wrong resume (lost moments, wrong step count) is off by ~1e-3.
    tol = 1e-6 if opt == "sgd" else 1e-5
    torch.testing.assert_close(first["losses"], ref["losses"][:K], rtol=tol, atol=0)
    seen = set()
    for rank in range(b.world_size):
        got = torch.load(str(tmp_path / f"b{rank}.pt"), weights_only=True)
        torch.testing.assert_close(got["losses"], ref["losses"][K:], rtol=tol, atol=0)
        for k, v in got["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=tol, atol=tol)
            seen.add(k)
    assert seen == set(ref["params"])


def test_bad_checkpoints_are_refused_with_a_reason(tmp_path):
    """One saved checkpoint, damaged two ways at once: a truncated layer file (stage 1's) and a layer of
    another shape (stage 0's). Every rank ends with exit 2 and its own reason."""
    from hethub.runtime.checkpoint import resolve_tag
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
    with pytest.raises(InputError, match="no complete checkpoint"):
        resolve_tag(str(tmp_path / "nowhere"), None)
    layer = ckpt / "global_step1" / "layer_04-model_states.pt"
    layer.write_bytes(layer.read_bytes()[:20])
    layer = ckpt / "global_step1" / "layer_02-model_states.pt"
    state = torch.load(layer, weights_only=True)
    state["0.weight"] = torch.zeros(5, 12)
    torch.save(state, layer)
    # the damage under digests that agree with it (as a writer with a bug would leave it): the reasons below
    _redigest(ckpt / "global_step1")
    results = spawn(a.world_size, [WORKER, pa, str(tmp_path / "c{rank}.pt"), "1", "2", "sgd", "0", "--load",
                                   str(ckpt)], timeout=90)
    assert all(rc == 2 for rc, _, _ in results)  # every rank ends, none hangs
    errs = [e.strip().splitlines()[-1] for _, _, e in results]
    assert all(e.startswith("error: checkpoint") for e in errs)
    stage0 = [errs[r.rank] for r in a.stages[0].replicas]
    stage1 = [errs[r.rank] for r in a.stages[1].replicas]
    assert all("layer 2 (Sequential).0.weight: checkpoint shape (5, 12), model shape (12, 12)" in e for e in stage0)
    assert all("layer_04-model_states.pt is truncated or corrupt" in e for e in stage1)


def _redigest(d) -> None:
    import hashlib
    meta = json.loads((d / "meta.json").read_text())
    meta["digests"] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.glob("*.pt"))}
    (d / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_is_resumed_only_from_inside_its_directory_and_only_as_saved(tmp_path):
    """What the resume directory holds is not trusted: a ``latest`` naming a path out of it, a tag that is a
    link out of it, and a layer file whose bytes changed after the save are each refused with one line on every
    rank (exit 2); before, the first two resumed from elsewhere and the last trained on silently (loss nan)."""
    from hethub.runtime.checkpoint import resolve_tag
    from hethub.partitioner import InputError
    a = stack_plan(*PLAN_A)
    pa = _write(tmp_path, "a", a)
    ckpt = tmp_path / "ckpt"
    _ok(spawn(a.world_size, [WORKER, pa, str(tmp_path / "a{rank}.pt"), "0", "1", "sgd", "0", "--save", str(ckpt)]))
    outside = tmp_path / "outside"
    shutil.copytree(ckpt / "global_step1", outside / "global_step8")
    for bad in ("../outside/global_step8", "../../../../etc/x", "/etc/passwd"):
        (ckpt / "latest").write_text(bad)
        with pytest.raises(InputError, match=r"names .* is not a checkpoint name inside"):
            resolve_tag(str(ckpt), None)
    os.symlink(outside / "global_step8", ckpt / "global_step8")
    (ckpt / "latest").write_text("global_step8")
    with pytest.raises(InputError, match=r"'global_step8' leads out of .*\(a link\): refused"):
        resolve_tag(str(ckpt), None)
    os.remove(ckpt / "global_step8")
    (ckpt / "latest").write_text("global_step1")
    layer = ckpt / "global_step1" / "layer_03-model_states.pt"
    data = bytearray(layer.read_bytes())
    data[-40:-8] = bytes(32)  # overwritten in place: the file still loads as a tensor file
    layer.write_bytes(bytes(data))
    results = spawn(a.world_size, [WORKER, pa, str(tmp_path / "c{rank}.pt"), "1", "2", "sgd", "0", "--load",
                                   str(ckpt)], timeout=90)
    assert all(rc == 2 for rc, _, _ in results), [e[-500:] for _, _, e in results]
    errs = [e.strip().splitlines()[-1] for _, _, e in results]
    holder = next(st for st in a.stages if st.layers[0] <= 3 < st.layers[1])
    for r in holder.replicas:
        assert "layer_03-model_states.pt does not match the digest saved with it" in errs[r.rank], errs[r.rank]
    assert all(e.startswith("error: checkpoint") for e in errs)


def test_sigkilled_rank_ends_every_other_rank_with_its_name(tmp_path):
    import signal
    import time
    from dist_util import free_port, rank_env, wait_for_line
    plan = stack_plan(*PLAN_A)
    path = _write(tmp_path, "a", plan)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join("tests", "workers", "train_stack.py"), path,
                               str(tmp_path / "k{rank}.pt"), "100000", "0"],
                              env=rank_env(r, 5, port, {"HEARTBEAT": "1"}), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(5)]
    try:
        wait_for_line(procs[0].stdout, r"^step [2-9]", timeout=90)  # training well under way
        assert all(p.poll() is None for p in procs)
        procs[3].send_signal(signal.SIGKILL)
        t0 = time.time()
        errs = []
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=60)
            if r != 3:
                assert p.returncode != 0
                errs.append(err.strip().splitlines()[-1])
        assert time.time() - t0 < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(e.startswith("error: rank") and " lost rank(s) " in e for e in errs), errs
    assert any("lost rank(s) " in e and "3" in e.split(" lost rank(s) ")[1].split(" during")[0] for e in errs)
