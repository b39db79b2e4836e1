"""hethub.split_backward: the input pass computes input gradients only, the weight pass the rest, and
together they equal one backward (float64)."""
import pytest
import torch
from torch import nn

from hethub.split_backward import SplitBackwardError, backward_input, backward_weight


class Stage(nn.Module):
    """Linear-Tanh-Linear, a LayerNorm, and a weight used twice (the second Linear's, applied again)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(6, 8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        return self.norm(self.b(h) + h)[:, :5]  # a view, as stage outputs often are


def _pair():
    torch.manual_seed(0)
    ref, split = Stage().double(), Stage().double()
    split.load_state_dict(ref.state_dict())
    return ref, split


def test_input_pass_leaves_weights_alone_and_weight_pass_completes_one_backward():
    ref, split = _pair()
    x_ref = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    dy = torch.randn(4, 5, dtype=torch.float64)
    for _ in range(2):  # two micro-batches accumulate, as in a pipeline
        ref(x_ref).backward(dy)
        weights = list(split.parameters())
        state = backward_input([split(x)], [dy], [x], weights, stage=1)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
        backward_weight(weights, state)
    for (name, p), q in zip(split.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=1e-15, msg=name)


def test_weights_untouched_until_the_weight_pass():
    _, split = _pair()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    weights = list(split.parameters())
    state = backward_input([split(x)], [torch.ones(3, 5, dtype=torch.float64)], [x], weights, stage=1)
    assert x.grad is not None and all(p.grad is None for p in weights)
    backward_weight(weights, state)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in weights)


def test_loss_root_on_the_last_stage():
    ref, split = _pair()
    x_ref = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    ref(x_ref).pow(2).mean().backward()
    weights = list(split.parameters())
    backward_weight(weights, backward_input([split(x).pow(2).mean()], None, [x], weights, stage=2))
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    for p, q in zip(weights, ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=1e-15)


def test_a_weight_independent_of_the_input_is_refused_with_the_schedule_to_use():
    bias = nn.Parameter(torch.ones(3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = x * 2 + bias.exp()  # the weight's path meets the input's at the add: split as usual
    backward_weight([bias], backward_input([out], [torch.ones(2, 3, dtype=torch.float64)], [x], [bias], 1))
    torch.testing.assert_close(bias.grad, 2 * bias.detach().exp())
    with pytest.raises(SplitBackwardError, match="stage 3 do not depend on the stage's input.*--schedule 1f1b"):
        backward_input([x.sum(), bias.exp().sum()], None, [x], [bias], stage=3)  # an output without the input
