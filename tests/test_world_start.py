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
from instances import CASES, stack_plan  # noqa: E402
from test_groups import mixed_vendor_plan  # noqa: E402


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
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
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
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    monkeypatch.setattr(startup.deepspeed, "init_distributed", lambda dist_backend, **kw: calls.append(("ds", dist_backend)))
    startup.init_distributed(30, plan)
    assert calls == [("ds", "gloo")]
