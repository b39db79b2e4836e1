"""The data-parallel all-reduce's buckets (hethub.runtime.buckets): gradients are views of the buckets (no flat
copy), a bucket starts while the backward still runs, strictly in index order, and the result is autograd's."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from hethub.runtime.buckets import Buckets, bucket_params


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "f"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()  # the rest of the session runs without a default group, as before


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


class Recorder:
    """The guard stand-in: runs each call, records each bucket start (the all-reduce's async launch)."""

    def __init__(self):
        self.launched = []

    def __call__(self, fn, what):
        out = fn()
        if what == "AR" and hasattr(out, "wait"):
            self.launched.append(out)
        return out


def test_buckets_cut_in_reverse_order_at_the_size():
    m = _model()
    ps = list(m.parameters())
    buckets = bucket_params(ps, 16 * 16 * 8)  # one 16x16 float64 weight per bucket
    assert [p for b in buckets for p in b] == ps[::-1]
    assert all(sum(p.numel() * 8 for p in b[:-1]) < 16 * 16 * 8 for b in buckets)
    assert len(buckets) > 1


def test_gradients_are_views_and_buckets_start_during_the_backward(world):
    m, ref = _model(), _model()
    x = torch.randn(5, 8, dtype=torch.float64)
    rec = Recorder()
    b = Buckets(list(m.parameters()), 600, world, False, rec)
    assert len(b.buckets) >= 3
    for step in range(2):  # the second iteration re-uses the views after the optimizer dropped the grads
        b.prepare()
        m(x).pow(2).sum().backward()  # an earlier micro-batch: nothing starts
        assert rec.launched == [] and b.next_launch == 0
        b.arm(frozenset(id(p) for p in m.parameters()))
        m(x).pow(2).sum().backward()  # the last one: every bucket starts inside this backward
        b.arm(frozenset())
        assert b.next_launch == len(b.buckets) and len(rec.launched) == len(b.buckets)
        for bucket in b.buckets:  # in place: each gradient lives in its bucket's buffer
            lo = bucket.flat.data_ptr()
            hi = lo + bucket.flat.numel() * bucket.flat.element_size()
            assert all(lo <= p.grad.data_ptr() < hi for p in bucket.viewed)
        b.finish()
        for p, q in zip(m.parameters(), ref.parameters()):
            q.grad = None
        ref(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        for p in m.parameters():
            p.grad = None  # what optimizer.zero_grad() does
        rec.launched.clear()


def test_a_bucket_ready_early_waits_for_the_ones_before_it(world):
    """Collectives run in issue order on a communicator: bucket k never starts before bucket k-1 on any rank."""
    m = _model()
    b = Buckets(list(m.parameters()), 600, world, False, Recorder())
    b.prepare()
    b.arm(frozenset(id(p) for p in m.parameters()))
    b.ready(b.buckets[1].params)
    assert b.next_launch == 0
    b.ready(b.buckets[0].params)
    assert b.next_launch == 2
    b.finish()


def test_a_parameter_without_gradient_has_none_after_the_reduce(world):
    """As without buckets: the optimizer skips a parameter no micro-batch gave a gradient."""
    m = _model()
    unused = nn.Parameter(torch.ones(3, dtype=torch.float64))
    b = Buckets([*m.parameters(), unused], 600, world, False, Recorder())
    b.prepare()
    b.arm(frozenset(id(p) for p in m.parameters()))
    m(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    b.finish()
    assert unused.grad is None
    assert all(p.grad is not None for p in m.parameters())
