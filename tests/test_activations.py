"""Tier 1 (one process): activation memory, measured (``hethub.runtime.activations``) and priced from profiles.

The meter counts what autograd keeps for backward: each storage once, parameters and autocast's copies of them
never, released as the backward frees it. The split backward (zb-h1, zb-v) keeps nothing once its weight pass ran;
the cost model takes the per-sample bytes profiles measured in place of the analytic formula's.
"""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hethub.runtime import split_backward  # noqa: E402
from hethub.runtime.activations import ActivationMeter  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh()).double()


def test_the_meter_counts_saved_activations_once_and_no_parameters():
    m = _mlp()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    meter = ActivationMeter(m.parameters())
    with meter:
        y = m(x)
    # Linear 1 keeps x (8x16); Tanh 1 keeps its output (8x32), which Linear 2 keeps again as its input (counted
    # once); Tanh 2 keeps its output (8x16). Weights: never.
    assert meter.held == 8 * (16 + 32 + 16) * 8
    y.sum().backward()
    assert meter.held == 0 and meter.peak == 8 * (16 + 32 + 16) * 8


def test_autocast_copies_of_weights_are_not_activations():
    m = _mlp().float()
    x = torch.randn(8, 16)
    meter = ActivationMeter(m.parameters())
    with meter, torch.autocast("cpu", dtype=torch.bfloat16):
        m(x).float().sum().backward()
    kept = meter.peak
    plain = ActivationMeter(())  # the same, counting everything: the bf16 weight copies show up
    with plain, torch.autocast("cpu", dtype=torch.bfloat16):
        m(x).float().sum().backward()
    assert 0 < kept < plain.peak


class _Mixed(nn.Module):
    """A plain Linear (its weight pass computed directly) and a weight used by a matmul (through the graph, which
    the input pass retains for it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16).double()
        self.w = nn.Parameter(torch.randn(16, 16, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(self.fc(x) @ self.w) * x


def test_the_split_weight_pass_keeps_nothing_alive():
    """zb-h1 / zb-v: after B (input gradients) and W (weight gradients) no activation of the micro-batch is held
    (the weight pass's products once recorded a graph on the forward's input and kept it in .grad; the meter
    once kept saved outputs with their grad_fn, a cycle a retained graph never frees)."""
    torch.manual_seed(0)
    m = _Mixed()
    weights = list(m.parameters())
    calls = split_backward.LinearCalls(m)
    meter = ActivationMeter(weights)
    for _ in range(3):
        with meter:
            x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
            with calls.capturing() as recorded:
                y = m(x)
            pending = split_backward.backward_input([y], [torch.ones_like(y)], [x], weights, 1, recorded)
            del y, recorded
            split_backward.backward_weight(weights, pending)
            del pending
        assert meter.held == 0
        assert all(p.grad.grad_fn is None for p in weights)


def test_between_the_split_passes_the_meter_counts_what_the_weight_pass_waits_with():
    """A plain Linear alone: the input pass frees autograd's graph (nothing but Linears needs it), yet the weight
    pass still holds the Linear's X and its output gradient dY; the meter counts both until the weight pass, and
    what autograd saved once (X) once."""
    lin = nn.Linear(16, 32, dtype=torch.float64)
    weights = list(lin.parameters())
    calls = split_backward.LinearCalls(lin)
    meter = ActivationMeter(weights)
    with meter:
        x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
        with calls.capturing() as recorded:
            y = torch.relu(lin(x))  # relu saves its output: freed with the graph after the input pass
        after_forward = meter.held
        pending = split_backward.backward_input([y], [torch.ones_like(y)], [x], weights, 1, recorded)
        del y
        assert not pending.groups and after_forward == (8 * 16 + 8 * 32) * 8  # X, relu's output
        assert meter.held == (8 * 16 + 8 * 32) * 8  # X, dY (relu's output freed with the graph)
        split_backward.backward_weight(weights, pending)
        del pending, recorded
        assert meter.held == 0


def test_profiled_activation_bytes_replace_the_formula_per_sample():
    from hethub.partitioner.costmodel import CostModel
    from hethub.partitioner.records import LayerProfile, Profile
    from instances import CPU_CLUSTER, STACK
    analytic = CostModel(CPU_CLUSTER, STACK, dtype="fp32")
    n = STACK.num_planner_layers

    def profile(mb):  # 1000 bytes per sample per layer, and 500 that do not grow with the micro-batch
        return Profile(model=STACK, device_type="CPU", micro_batch_size=mb, dtype="fp32", layers=[
            LayerProfile(index=i, kind="embedding" if i == 0 else "head" if i == n - 1 else "block", forward_ms=1,
                         backward_ms=2, activation_bytes=500 + 1000 * mb) for i in range(n)])
    measured = CostModel(CPU_CLUSTER, STACK, dtype="fp32", profiles=[profile(1), profile(4)])
    loss = 4.0 * STACK.seq_length * STACK.vocab_size  # the loss's fp32 log-probabilities: no profile sees them
    assert list(measured.layers.act_bytes) == pytest.approx([1000.0] * (n - 1) + [1000.0 + loss])
    assert list(analytic.layers.act_bytes) != pytest.approx([1000.0] * n)
    # without measured split passes a layer waits for its weight pass with its graph and its outputs' gradients
    assert all(analytic.wait_bytes()[1:] > analytic.act_bytes()[1:])


def test_profiled_weight_pass_bytes_replace_the_formula_per_sample():
    """A profile that measured what the weight pass waits with (``weight_pass_bytes``): per sample the layer then
    holds that between its split passes (a plain-Linear layer frees its graph, and holds less than its forward
    left: measured 600 against 1000 bytes per sample here); layers without it keep the formula's extra."""
    from hethub.partitioner.costmodel import CostModel
    from hethub.partitioner.records import LayerProfile, Profile
    from instances import CPU_CLUSTER, STACK
    n = STACK.num_planner_layers
    analytic = CostModel(CPU_CLUSTER, STACK, dtype="fp32")

    def profile(mb):
        return Profile(model=STACK, device_type="CPU", micro_batch_size=mb, dtype="fp32", layers=[
            LayerProfile(index=i, kind="embedding" if i == 0 else "head" if i == n - 1 else "block", forward_ms=1,
                         backward_ms=2, activation_bytes=500 + 1000 * mb,
                         **({"input_grad_ms": 1, "weight_grad_ms": 1, "weight_pass_bytes": 300 + 600 * mb}
                            if i == 1 else {})) for i in range(n)])
    measured = CostModel(CPU_CLUSTER, STACK, dtype="fp32", profiles=[profile(1), profile(4)])
    assert measured.wait_bytes()[1] == pytest.approx(600.0)
    extra = analytic.wait_bytes()[2:] - analytic.act_bytes()[2:]
    assert list(measured.wait_bytes()[2:] - measured.act_bytes()[2:]) == pytest.approx(list(extra))
