"""Emulated slowdown on a fake clock: what a wrapped layer's forward and backward take, exactly."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hethub.emulated import slowdown as emulation
from hethub.emulated.slowdown import SlowDown

FWD_S, BWD_S, K = 1.0, 2.0, 3.0


class Clock:
    """Stands for ``time`` in hethub.emulation: sleeping and computing both move it, nothing waits."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.now += s


class Tick(torch.autograd.Function):
    """A layer whose forward takes FWD_S and backward BWD_S on the clock."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        ctx.save_for_backward(x)  # a saved activation: what checkpointing drops and recomputes
        clock.now += FWD_S
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        ctx.clock.now += BWD_S
        return 2 * x * g, None


class Layer(torch.nn.Module):
    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def forward(self, x):
        return Tick.apply(x, self.clock)


@pytest.mark.parametrize("recompute,early_stop", [(False, True), (True, True), (True, False)],
                         ids=["plain", "recompute", "recompute-whole-forward"])
def test_a_slowed_layer_takes_k_times_its_work_recomputed_forward_included(monkeypatch, recompute, early_stop):
    """Checkpointing's recompute stops at the last saved tensor by default (the wrapper's idle never runs: the
    recomputed forward's real time falls in the measured backward); without early stop the whole wrapped
    forward runs again and idles itself, and is kept out of the backward's measurement."""
    clock = Clock()
    monkeypatch.setattr(emulation, "time", clock)
    layer = SlowDown(Layer(clock), K)
    times = []
    for _ in range(3):  # the first call of each phase only sets its reference
        x = torch.full((2, 3), 1.5, dtype=torch.float64, requires_grad=True)
        t0 = clock.now
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            y = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        t1 = clock.now
        y.sum().backward()
        times.append((t1 - t0, clock.now - t1))
        assert torch.equal(x.grad, torch.full_like(x, 3.0))
    # a recomputed layer runs its forward again inside its backward: k x that forward, not k x k
    backward_s = K * (FWD_S + BWD_S) if recompute else K * BWD_S
    assert times[1:] == [(K * FWD_S, backward_s)] * 2, times
