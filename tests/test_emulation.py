"""Emulated slowdown on a fake clock: what a wrapped layer's forward and backward take, exactly."""
import copy

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
    """``work`` (an autograd Function moving the clock) as a module: by default Tick, a layer's compute."""

    def __init__(self, clock, work=Tick):
        super().__init__()
        self.clock, self.work = clock, work

    def forward(self, x):
        return self.work.apply(x, self.clock)


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


PIN_FWD_S, PIN_BWD_S = 5.0, 7.0


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_a_pinned_layer_takes_its_pinned_times_from_the_first_call(monkeypatch, recompute):
    """Pinned (``hethub.emulated.pinned``), a layer's passes end at their given seconds however long its real work
    took and from the first call on (no reference to learn); a recomputed forward idles to its own pin inside the
    backward. A recomputing stage's backward pin holds its forward again (``pins_for``), whether checkpointing
    stops the recompute early or runs the wrapped forward whole. Inputs of another row count than the pin's fall
    back to k x the fastest time seen (the first call only sets the reference)."""
    clock = Clock()
    monkeypatch.setattr(emulation, "time", clock)
    bwd_s = PIN_BWD_S + (PIN_FWD_S if recompute else 0.0)
    layer = SlowDown(Layer(clock), K, pinned=(2, {"fwd": PIN_FWD_S, "bwd": bwd_s}))
    unpinned = (3, (FWD_S, BWD_S + (FWD_S if recompute else 0.0)), True)  # its real times: a first call
    for rows, expected, early_stop in [(2, (PIN_FWD_S, bwd_s), True), (2, (PIN_FWD_S, bwd_s), False), unpinned]:
        x = torch.full((rows, 3), 1.5, dtype=torch.float64, requires_grad=True)
        t0 = clock.now
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            y = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        t1 = clock.now
        y.sum().backward()
        assert (t1 - t0, clock.now - t1) == expected
        assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_a_pin_shorter_than_the_work_adds_no_idle(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(emulation, "time", clock)
    layer = SlowDown(Layer(clock), K, pinned=(2, {"fwd": FWD_S / 2, "bwd": BWD_S / 2}))
    x = torch.ones((2, 3), dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert clock.now == FWD_S
    y.sum().backward()
    assert clock.now == FWD_S + BWD_S


class HostWork(torch.autograd.Function):
    """Host work between two layers (the runtime's own Python, a kernel launch): GAP_S each way on the clock."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        clock.now += GAP_S
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.clock.now += GAP_S
        return g, None


GAP_S = 0.5


@pytest.mark.parametrize("pin_fwd_s,pin_bwd_s", [(PIN_FWD_S, PIN_BWD_S), (FWD_S / 2, BWD_S / 2)],
                         ids=["device-bound", "host-bound"])
def test_a_chunks_pinned_layers_queue_on_one_device_clock(monkeypatch, pin_fwd_s, pin_bwd_s):
    """A chunk's pinned layers share the rank's device clock and wait for it only where a pass ends (the last
    layer's forward, the first layer's backward): host work between them overlaps the emulated device, as kernel
    launches overlap a GPU's kernels, and a pass takes max(its pins, its host time). Layers each with a clock of
    their own add the host work to their pins."""
    clock = Clock()
    monkeypatch.setattr(emulation, "time", clock)
    pins = (2, {"fwd": pin_fwd_s, "bwd": pin_bwd_s})
    device = emulation.DeviceClock()
    shared = torch.nn.Sequential(SlowDown(Layer(clock), K, pins, device, sync=(False, True)), Layer(clock, HostWork),
                                 SlowDown(Layer(clock), K, pins, device, sync=(True, False)))
    alone = torch.nn.Sequential(SlowDown(Layer(clock), K, pins), Layer(clock, HostWork),
                                SlowDown(Layer(clock), K, pins))
    host_fwd_s, host_bwd_s = 2 * FWD_S + GAP_S, 2 * BWD_S + GAP_S
    for chunk, gaps_add in ((shared, False), (alone, True)):
        x = torch.full((2, 3), 1.5, dtype=torch.float64, requires_grad=True)
        t0 = clock.now
        y = chunk(x)
        t1 = clock.now
        y.sum().backward()
        if pin_fwd_s > FWD_S and gaps_add:
            expected = (2 * pin_fwd_s + GAP_S, 2 * pin_bwd_s + GAP_S)
        else:
            expected = (max(2 * pin_fwd_s, host_fwd_s), max(2 * pin_bwd_s, host_bwd_s))
        assert (t1 - t0, clock.now - t1) == expected
        assert torch.equal(x.grad, 4 * 1.5 ** 3 * torch.ones_like(x))  # d/dx x^4


def test_pins_add_up_to_what_the_simulator_replays(tmp_path):
    """Every layer's pins of a chunk sum to the chunk's passes as the simulator prices them (``pass_times_s``):
    the pinned emulated device is the cost model's, split chunks (zb-v's, but its first) included."""
    from hethub.emulated.pinned import pins_for
    from hethub.partitioner import Cluster, ModelConfig
    from hethub.partitioner.chunked import rechunk
    from hethub.partitioner.costmodel import cost_model_for, pass_times_s
    from hethub.partitioner.placement import StageLayout, build_plan
    from hethub.cli.demo import DEMO_CLUSTER
    from hethub.cli.profiler import profile_model
    model = ModelConfig.model_validate({"name": "pin", "architecture": "gpt", "num_layers": 4, "hidden_size": 32,
                                        "num_attention_heads": 2, "ffn_hidden_size": 64, "vocab_size": 64,
                                        "seq_length": 8})
    cluster = Cluster.model_validate(DEMO_CLUSTER)  # FAST and SLOW ranks
    profiles = [profile_model(model, t, mb, "fp32", warmup=1, reps=1, progress=False)
                for t in ("FAST", "SLOW") for mb in (1, 2)]
    base = build_plan(model, cluster, [StageLayout((0, 3), "FAST", (2,)), StageLayout((3, 6), "SLOW", (1, 1))],
                      2, 3)
    plan = rechunk(base.model_copy(update={"dtype": "fp32"}), "zb-v", 2)
    cm = cost_model_for(plan, profiles)
    for s, st in enumerate(plan.stages):
        rows = st.replicas[0].samples
        split = {k for k in plan.chunks_of_group[s] if k > 0}
        pins = pins_for(plan, profiles, s, st.device_type, rows, split)
        for k in plan.chunks_of_group[s]:
            c = plan.pipeline[k]
            fwd, bwd, wgt = pass_times_s(cm, st.device_type, c.first, c.last, rows, False, 1, k in split)
            assert sum(pins.layer_s[i]["fwd"] for i in range(c.first, c.last)) == pytest.approx(fwd, rel=1e-12)
            assert sum(pins.layer_s[i]["bwd"] for i in range(c.first, c.last)) == pytest.approx(bwd, rel=1e-12)
            assert pins.weight_s.get(k, 0.0) == pytest.approx(wgt, rel=1e-12) and (wgt > 0) == (k in split)


def test_pinned_emulation_needs_a_profile_per_emulated_type(tmp_path, monkeypatch):
    from hethub.emulated.pinned import PROFILES_ENV, check_pin_profiles, load_pin_profiles
    from hethub.partitioner.errors import InputError
    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))
    with pytest.raises(InputError, match=f"^{PROFILES_ENV}: no profile \\(a \\*.json with device_type and layers\\) in"):
        load_pin_profiles()
    monkeypatch.setenv(PROFILES_ENV, "")
    assert load_pin_profiles() is None
    from hethub.cli.demo import DEMO_CLUSTER, DEMO_MODEL
    from hethub.cli.profiler import profile_model
    from hethub.partitioner import Cluster, ModelConfig
    from hethub.partitioner.placement import StageLayout, build_plan
    model, cluster = ModelConfig.model_validate(DEMO_MODEL), Cluster.model_validate(DEMO_CLUSTER)
    plan = build_plan(model, cluster, [StageLayout((0, model.num_planner_layers), "SLOW", (1,))], 1, 2)
    with pytest.raises(InputError, match=f"^{PROFILES_ENV}: no profile for device type 'SLOW'"):
        check_pin_profiles(plan, [], {"SLOW"})
    other = model.model_copy(update={"name": "other", "hidden_size": 64})
    with pytest.raises(InputError, match=f"^{PROFILES_ENV}: profiles\\[0\\].model: profile was measured on model"):
        check_pin_profiles(plan, [profile_model(other, "SLOW", 1, "fp32", warmup=0, reps=1, progress=False)],
                           {"SLOW"})


def test_a_slowed_in_place_layer_trains_like_the_unwrapped_one_and_copies_only_where_it_writes():
    """nn.ReLU(inplace=True) after another layer (DeepSpeed's tutorial cut): autograd forbids writing into the
    wrapper's view of the input, so the wrapper hands that layer a copy; a layer that writes nothing gets a view."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2)).double()
    slowed = torch.nn.Sequential(*[SlowDown(m, 1.0) for m in copy.deepcopy(plain)])
    for _ in range(2):  # the probe's call, then the decided one
        x = torch.randn(3, 4, dtype=torch.float64)
        plain.zero_grad()
        slowed.zero_grad()
        plain(x).square().sum().backward()
        slowed(x).square().sum().backward()
        for p, q in zip(plain.parameters(), slowed.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
    assert [m._writes_input for m in slowed] == [False, True, False]
