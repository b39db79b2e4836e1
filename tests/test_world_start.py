"""Tier 1: how each rank starts the world on a GPU machine, recorded on CPU with a CUDA-like accelerator.

DeepSpeed 0.19 binds the device (``device_id``) whenever the accelerator is CUDA; torch then builds every later
NCCL group by splitting the world's communicator. A gloo world (a plan spanning vendors) has none to split, and a
gloo subgroup of some ranks in a bound NCCL world makes the others run a split its members never join. hethub
creates the world itself: these tests record the ``init_process_group`` and ``new_group`` calls each rank makes.
"""
import pytest

pytest.importorskip("deepspeed")

import torch.distributed as dist  # noqa: E402

from hethub.partitioner.groups import ACCEL, GLOO, group_specs, world_start  # noqa: E402
from hethub.runtime import startup  # noqa: E402
from instances import CASES, mixed_vendor_plan, stack_plan  # noqa: E402


class FakeCuda:
    def device_name(self):
        return "cuda"

    def communication_backend_name(self):
        return "nccl"

    def device(self, index):
        return f"cuda:{index}"


def record_world_start(monkeypatch, plan, rank: int) -> list:
    calls = []
    monkeypatch.setattr(startup, "get_accelerator", lambda: FakeCuda())
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(startup.deepspeed.comm, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(startup, "_joined_store", lambda plan, join_timeout_s: {})  # the join: hethub.runtime.join
    monkeypatch.setattr(startup.deepspeed, "init_distributed",
                        lambda dist_backend, **kw: calls.append(("deepspeed", dist_backend, "device_id" in kw)))
    for k, v in {"RANK": rank, "LOCAL_RANK": rank % 4, "WORLD_SIZE": plan.world_size, "MASTER_ADDR": "h",
                 "MASTER_PORT": 1}.items():
        monkeypatch.setenv(k, str(v))
    startup.init_distributed(30, plan)
    return calls


def test_a_mixed_vendor_world_is_gloo_and_binds_no_device(monkeypatch):
    plan = mixed_vendor_plan()
    for rank in range(plan.world_size):
        calls = record_world_start(monkeypatch, plan, rank)
        assert calls[0][0] == "init" and calls[0][1] == "gloo" and "device_id" not in calls[0][2], calls
        assert calls[1] == ("deepspeed", "gloo", False)  # DeepSpeed finds the world: no second init, no binding
    # the groups every rank then creates, in one order: NCCL ones never span vendors, none splits from the world
    assert any(s.backend == ACCEL for s in group_specs(plan)) and world_start(plan, False).backend == GLOO


def test_a_one_vendor_world_binds_the_device_unless_a_host_boundary_needs_gloo_subgroups(monkeypatch):
    plain = stack_plan(*CASES["2to3"])
    bridged = stack_plan(*CASES["bridge2to3"])
    for rank in range(plain.world_size):
        calls = record_world_start(monkeypatch, plain, rank)
        assert calls[0] == ("init", "nccl", {"timeout": calls[0][2]["timeout"], "device_id": f"cuda:{rank % 4}"})
        calls = record_world_start(monkeypatch, bridged, rank)
        assert calls[0][1] == "nccl" and "device_id" not in calls[0][2], calls
    assert [s.backend for s in group_specs(bridged) if s.on_host] == [GLOO, GLOO]
    assert world_start(None, True).backend == GLOO and not world_start(None, True).bind_device


def test_without_a_launcher_environment_deepspeed_discovers_the_world(monkeypatch):
    plan = mixed_vendor_plan()
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    calls = []
    monkeypatch.setattr(startup, "get_accelerator", lambda: FakeCuda())
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(startup.deepspeed.comm, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    monkeypatch.setattr(startup.deepspeed, "init_distributed", lambda dist_backend, **kw: calls.append(("ds", dist_backend)))
    startup.init_distributed(30, plan)
    assert calls == [("ds", "gloo")]


def test_a_small_cuda_device_max_connections_is_warned_about_on_gpus_only():
    from hethub.runtime.checks import connections_note
    note = connections_note(4, True, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert note.startswith("hethub: warning: CUDA_DEVICE_MAX_CONNECTIONS=1 is below the 4 NCCL/RCCL groups")
    assert connections_note(4, True, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) is None
    assert connections_note(4, True, {}) is None and connections_note(4, False, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None


def test_the_watchdog_ends_a_rank_stuck_in_an_action_with_the_lost_peer_line():
    """On NCCL a receive whose peer died never raises: hethub's watchdog ends the rank with one line instead,
    naming the peers and the action; a rank back in the user's code (idle) is never ended."""
    import subprocess
    import sys
    from conftest import ROOT
    code = ("import time\nfrom hethub.runtime.errors import Guard\n"
            "g = Guard(3, 1, 4, lambda: 7)\ng.start_watchdog(0.5)\n"
            "g.watch([0, 2], 'idle user code')\ng.idle()\ntime.sleep(1.5)\n"
            "g.watch([0, 2], 'RA3<r0[0:2]')\ntime.sleep(5)\nprint('not ended')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 3 and len(lines) == 1 and "not ended" not in r.stdout, r.stderr
    assert lines[0].startswith("error: rank 3 (stage 1) lost rank(s) 0, 2 during RA3<r0[0:2] at step 7: no progress "
                               "for 0.5 s"), lines
