"""Tier 1: a plan's process groups (``partitioner.groups``): which ranks, which backend, one per boundary direction.

The rule under test: no group that is not gloo spans vendors (NCCL and RCCL do not talk to each other), a host
boundary is gloo, and every transfer a schedule posts goes to a group holding both of its ends.
"""
import json

import pytest

from hethub.partitioner import Cluster, ModelConfig, Plan
from hethub.partitioner.groups import (ACCEL, GLOO, group_specs, spans_vendors, transfer_group, vendor_of_rank,
                                       world_backend)
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.schedule import build_schedule
from instances import CASES, mixed_vendor_plan, stack_plan

def test_no_group_but_gloo_spans_vendors_on_a_mixed_vendor_plan():
    plan = mixed_vendor_plan()
    vendors = vendor_of_rank(plan)
    assert spans_vendors(plan) and world_backend(plan) == GLOO
    specs = group_specs(plan, tie_layers=[(0, 6)])  # an embedding tied to the head: stages 0 and 2
    for spec in specs:
        if len({vendors[r] for r in spec.ranks}) > 1:
            assert spec.backend == GLOO, spec
    # what is gloo and what is not, by purpose
    by = {(s.purpose, s.stage, s.index): s for s in specs}
    assert by[("dp", 0, 0)].backend == ACCEL and by[("dp", 2, 0)].backend == ACCEL
    assert by[("dp", 1, 0)].backend == GLOO  # stage 1's replicas span vendors: its all-reduce goes over the host
    assert by[("tie", None, 0)].backend == GLOO
    assert [s.backend for s in specs if s.purpose in ("fwd", "bwd")] == [GLOO] * 4  # both boundaries: the bridge


def test_a_one_vendor_plan_keeps_the_accelerators_backend_but_for_host_boundaries():
    plan = stack_plan(*CASES["bridge2to3"])  # one vendor, one boundary marked host
    assert not spans_vendors(plan) and world_backend(plan) == ACCEL
    specs = group_specs(plan)
    assert {s.backend for s in specs if s.purpose not in ("fwd", "bwd")} == {ACCEL}
    assert [s.backend for s in specs if s.purpose in ("fwd", "bwd")] == [GLOO, GLOO]


@pytest.mark.parametrize("name", list(CASES))
def test_one_group_per_boundary_and_direction_holding_both_ends_of_every_transfer(name):
    plan = stack_plan(*CASES[name])
    specs = group_specs(plan)
    p2p = {(s.purpose, s.stage): s for s in specs if s.purpose in ("fwd", "bwd")}
    assert len(p2p) == 2 * (plan.num_stages - 1) == len([s for s in specs if s.purpose in ("fwd", "bwd")])
    for rank, actions in build_schedule(plan).items():
        stage = plan.locate(rank)[0]
        for a in actions:
            if a.transfers:
                spec = p2p[transfer_group(a.kind, stage)]
                assert rank in spec.ranks and all(t.peer in spec.ranks for t in a.transfers), (rank, str(a))


def test_every_rank_is_in_exactly_one_data_parallel_and_one_self_group():
    plan = mixed_vendor_plan()
    specs = group_specs(plan)
    for r in range(plan.world_size):
        assert sum(r in s.ranks for s in specs if s.purpose == "dp") == 1
        assert sum(s.ranks == (r,) for s in specs if s.purpose == "self") == 1
