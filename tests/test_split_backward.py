"""hethub.split_backward: the input pass computes input gradients only, the weight pass the rest, and
together they equal one backward (float64)."""
import pytest
import torch
from torch import nn

from hethub.runtime.split_backward import LinearCalls, SplitBackwardError, backward_input, backward_weight


class Stage(nn.Module):
    """Linear-Tanh-Linear, a LayerNorm, and a weight used twice (the second Linear's, applied again)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(6, 8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)))
        return self.norm(self.b(h) + h)[:, :5]  # a view, as stage outputs often are


class Checkpointed(nn.Module):
    """A stage under activation checkpointing, as Hugging Face models run with gradient checkpointing on."""

    def __init__(self, inner: nn.Module, reentrant: bool):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _pair():
    torch.manual_seed(0)
    ref, split = Stage().double(), Stage().double()
    split.load_state_dict(ref.state_dict())
    return ref, split


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "non-reentrant-checkpoint"])
@pytest.mark.parametrize("direct", [False, True], ids=["graph", "direct-linears"])
def test_input_pass_leaves_weights_alone_and_weight_pass_completes_one_backward(direct, checkpointed):
    """Also under non-reentrant activation checkpointing (a plan's recompute stage; Hugging Face's gradient
    checkpointing), which keeps autograd's graph: saved tensors are recomputed on use."""
    ref, split = _pair()
    if checkpointed:
        split = Checkpointed(split, reentrant=False)
    linears = LinearCalls(split) if direct else None
    x_ref = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    dy = torch.randn(4, 5, dtype=torch.float64)
    for _ in range(2):  # two micro-batches accumulate, as in a pipeline
        ref(x_ref).backward(dy)
        weights = list(split.parameters())
        if direct:
            with linears.capturing() as calls:
                out = split(x)
        else:
            out, calls = split(x), ()
        state = backward_input([out], [dy], [x], weights, stage=1, calls=calls)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
        # the Linears (b called twice) skip the graph; only the LayerNorm's weights resume from it
        assert len(state.calls) == (3 if direct else 0)
        assert sum(len(g.weights) for g in state.groups) == (2 if direct else 6)
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


def test_a_linear_weight_used_outside_its_calls_is_left_to_the_graph():
    """A weight the Linear's calls do not alone consume (here also used directly) must not skip the graph:
    dY^T X would miss the other use's gradient."""
    torch.manual_seed(1)
    lin = nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def f(t):
        return lin(t) + t @ lin.weight  # the weight twice: once by the call, once directly

    f(x.detach().clone().requires_grad_()).sum().backward()
    want = {n: p.grad.clone() for n, p in lin.named_parameters()}
    lin.zero_grad(set_to_none=True)
    linears = LinearCalls(lin)
    with linears.capturing() as calls:
        out = f(x)
    assert len(calls) == 1
    state = backward_input([out.sum()], None, [x], list(lin.parameters()), stage=1, calls=calls)
    assert state.calls == [] and sum(len(g.weights) for g in state.groups) == 2  # weight and bias via the graph
    backward_weight(list(lin.parameters()), state)
    for n, p in lin.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-13, atol=1e-15, msg=n)
    linears.remove()


def test_direct_linears_under_bf16_autocast_match_the_graph():
    """Under autocast the Linear runs in bf16; the direct product casts X as autocast did and returns the
    weight's dtype, like the cast's backward."""
    torch.manual_seed(2)
    grads = []
    for direct in (False, True):
        torch.manual_seed(2)
        stage = Stage()
        x = torch.randn(8, 6, requires_grad=True)
        linears = LinearCalls(stage)
        with torch.autocast("cpu", dtype=torch.bfloat16), (linears.capturing() if direct else
                                                            __import__("contextlib").nullcontext()) as calls:
            out = stage(x)
        weights = list(stage.parameters())
        backward_weight(weights, backward_input([out.float().sum()], None, [x], weights, 1, calls=calls or ()))
        grads.append([p.grad for p in weights])
        assert all(g.dtype == torch.float32 for g in grads[-1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16 products, summed in another order


def test_reentrant_checkpointing_is_refused_with_what_to_use():
    """torch.autograd.grad cannot enter a reentrant checkpoint's backward (torch raises in the middle of the
    iteration): the input pass says so first, naming the stage and both ways out."""
    split = Checkpointed(Stage().double(), reentrant=True)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    weights = list(split.parameters())
    with pytest.raises(SplitBackwardError, match=r"stage 3 uses reentrant activation checkpointing .*"
                                                 r"use_reentrant=False.*--schedule 1f1b"):
        backward_input([split(x)], [torch.ones(4, 5, dtype=torch.float64)], [x], weights, stage=3)
    assert all(p.grad is None for p in weights) and x.grad is None  # nothing half-done


class Branching(Stage):
    """A stage whose graph's structure depends on a flag: the second Linear is skipped when ``short``."""
    short = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.norm(h if self.short else self.b(h) + h)[:, :5]


@pytest.mark.parametrize("direct", [False, True], ids=["graph", "direct-linears"])
def test_the_walk_cache_reuses_a_repeated_structure_and_redoes_a_changed_one(monkeypatch, direct):
    """A chunk's split is walked once per graph structure: micro-batches of one structure reuse it by node
    position, a changed structure (another branch) is walked again, and every micro-batch's gradients equal
    one backward's."""
    from hethub.runtime import split_backward
    walks = []
    real = split_backward._groups
    monkeypatch.setattr(split_backward, "_groups", lambda *a, **k: walks.append(1) or real(*a, **k))
    torch.manual_seed(0)
    ref, split = Branching().double(), Branching().double()
    split.load_state_dict(ref.state_dict())
    linears, cache = LinearCalls(split), split_backward.WalkCache()
    weights = list(split.parameters())
    for short in (False, False, True, True, False):
        ref.short = split.short = short
        x_ref = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
        x = x_ref.detach().clone().requires_grad_()
        dy = torch.randn(4, 5, dtype=torch.float64)
        ref(x_ref).backward(dy)
        if direct:
            with linears.capturing() as calls:
                out = split(x)
        else:
            out, calls = split(x), ()
        backward_weight(weights, backward_input([out], [dy], [x], weights, stage=1, calls=calls, cache=cache))
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    assert len(walks) == 3  # the first structure, the short one, the first again
    for (name, p), q in zip(split.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=1e-15, msg=name)
