"""Tier 1: the analytic cost model; tier 2 (torch, seconds): the profiler and its merge."""
import math
import random
import re

import numpy as np
import pytest

from hethub.partitioner import Cluster, InputError, LayerProfile, Profile, builtin_model
from hethub.partitioner.costmodel import (CostModel, work_bound_samples_per_s, allreduce_end_s, block_activation_bytes, block_forward_flops,
                                          calibrate_efficiency, layer_costs)
from hethub.partitioner.evaluate import stage_costs
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.simulator import simulate
from instances import MIXED

def test_block_flops_match_the_textbook_formula():
    m = builtin_model("gpt-1.3b")  # MHA, ffn = 4h: 24 s h^2 + 4 s^2 h
    s, h = m.seq_length, m.hidden_size
    assert block_forward_flops(m) == pytest.approx(24 * s * h * h + 4 * s * s * h)


@pytest.mark.parametrize("name,billions", [("llama-7b", 6.74), ("llama-13b", 13.0), ("llama-70b", 69.0),
                                           ("gpt-6.7b", 6.86)])
def test_parameter_counts(name, billions):
    assert layer_costs(builtin_model(name)).params.sum() / 1e9 == pytest.approx(billions, rel=0.01)


def test_boundary_bytes_follow_the_training_dtype_and_match_what_the_runtime_sends():
    """Stage boundaries carry the activations' own element size: 2 bytes in 16-bit training, 4 in fp32 (an fp32
    run priced at 2 bytes sent twice the predicted bytes across hosts); a boundary cast scales from there."""
    torch = pytest.importorskip("torch")
    from hethub.models.builtin import build_layers, counting_batches
    m = builtin_model("gpt-tiny")
    c16, c32 = CostModel(MIXED, m, dtype="bf16"), CostModel(MIXED, m, dtype="fp32")
    assert c32.layers.out_bytes[1] == 2 * c16.layers.out_bytes[1] == 4 * m.seq_length * m.hidden_size
    assert c32.layers.act_bytes[1] == 2 * c16.layers.act_bytes[1]
    assert (c32.wire_factor(None), c32.wire_factor("bf16"), c16.wire_factor("fp32")) == (1.0, 0.5, 2.0)
    # what an fp32 run of hethub's own layers hands to the next stage, per sample, after each layer but the head
    layers = build_layers(m)
    x, _ = counting_batches(0, 1, 3, m.seq_length, m.vocab_size)[0]
    with torch.no_grad():
        for i, layer in enumerate(layers[:-1]):
            x = layer(x)
            assert x.element_size() * x.numel() / 3 == c32.layers.out_bytes[i], i


def test_activation_bytes_korthikanti():
    m = builtin_model("gpt-1.3b")  # ffn = 4h: s h (34 + 5 a s / h) bytes without flash attention
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    assert block_activation_bytes(m, flash_attention=False) == pytest.approx(s * h * (34 + 5 * a * s / h))
    assert block_activation_bytes(m, flash_attention=True) == pytest.approx(s * h * 34)


def test_faster_device_is_faster_and_upper_bound_adds_up():
    cm = CostModel(MIXED, builtin_model("gpt-1.3b"))
    assert cm.sample_s("A100-80GB") < cm.sample_s("V100-32GB")
    ub = cm.upper_bound_samples_per_s()  # at least "each device alone", close to it analytically
    alone = sum(c / cm.sample_s(t) for t, c in MIXED.count_by_type().items())
    assert alone * (1 - 1e-9) <= ub <= alone * 1.05
    fwd, bwd = cm.stage_compute_s("A100-80GB", 1, 5, 2)
    fwd_r, bwd_r = cm.stage_compute_s("A100-80GB", 1, 5, 2, recompute=True)
    assert fwd_r == fwd and bwd_r == pytest.approx(bwd + fwd)
    p = cm.prefix("A100-80GB")
    assert p[5] - p[1] == pytest.approx((fwd + bwd) / 2)


def test_memory_model_recompute_saves_and_state_is_sixteen_bytes_a_parameter():
    cm = CostModel(MIXED, builtin_model("llama-7b"))
    assert cm.layers.act_bytes_recompute[1:9].sum() < 0.2 * cm.act_bytes()[1:9].sum()
    assert cm.state_bytes(1, 9) == pytest.approx(16 * cm.stage_params(1, 9))
    z = CostModel(MIXED, builtin_model("llama-7b"), zero1=True)
    assert z.state_bytes(1, 9, width=4) == pytest.approx((4 + 3) * cm.stage_params(1, 9))


def test_links():
    cm = CostModel(MIXED, builtin_model("gpt-1.3b"))
    nb = 64 * 2 ** 20
    intra = cm.p2p_s(nb, "A100-80GB", "A100-80GB", same_host=True)
    inter = cm.p2p_s(nb, "A100-80GB", "V100-32GB", same_host=False)
    cross = cm.p2p_s(nb, "A100-80GB", "MI250X", same_host=False)
    assert intra < inter < cross  # cross-vendor adds two host copies
    p = nb / 4  # parameters whose fp32 gradients (bf16 autocasts over fp32 weights) are nb bytes
    assert cm.sync_s(p, ["A100-80GB"], 1, True) == 0
    assert cm.sync_s(p, ["A100-80GB"], 4, True) < cm.sync_s(p, ["A100-80GB"], 4, False)
    # ring all-reduce over one node: 2 (w-1)/w of the buffer and 2 (w-1) hops per 25 MiB bucket (three) on the
    # NVLink-class link
    gbps, lat = cm._link_gbps("A100-80GB", "A100-80GB", True)
    assert cm.num_buckets(p) == 3
    assert cm.sync_s(p, ["A100-80GB"], 4, True) == pytest.approx(3 * 6 * lat + 1.5 * nb * 8 / (gbps * 1e9))
    # a same-vendor mixed stage runs at its slowest type's link; one spanning vendors through the host bridge
    same = cm.sync_s(p, ["A100-80GB", "V100-32GB"], 4, False)
    assert same == max(cm.sync_s(p, [t], 4, False) for t in ("A100-80GB", "V100-32GB"))
    assert cm.sync_s(p, ["A100-80GB", "MI250X"], 4, False) > same
    # ZeRO-1 adds the all-gather of the updated parameters: half an all-reduce more volume
    z = CostModel(MIXED, builtin_model("gpt-1.3b"), zero1=True)
    assert z.sync_s(p, ["A100-80GB"], 4, True) == pytest.approx((3 * 6 + 3) * lat + 2.25 * nb * 8 / (gbps * 1e9))
    # arrays in, arrays out (the planner prices every layer range at once), the same numbers
    many = z.sync_s(np.array([p, 2 * p]), ["A100-80GB"], 4, True)
    assert many[0] == pytest.approx(z.sync_s(p, ["A100-80GB"], 4, True))


def _profile(model, device_type, layers, mbs=2, ms=1.0, tp=1):
    return Profile(device_type=device_type, model=model, micro_batch_size=mbs, tensor_parallel=tp,
                   layers=[LayerProfile(index=i, kind=model.layers()[i].kind, forward_ms=ms, backward_ms=2 * ms)
                           for i in layers])


def test_profile_merge_measured_wins_and_missing_layers_fall_back():
    m = builtin_model("gpt-tiny")
    prof = _profile(m, "A100-80GB", range(0, 4))
    cm = CostModel(MIXED, m, profiles=[prof])
    d = cm.devices["A100-80GB"]
    assert d.fwd_s[2] == pytest.approx(1e-3 / 2) and d.bwd_s[2] == pytest.approx(2e-3 / 2)
    assert d.measured[:4].all() and not d.measured[4:].any()
    assert any("lacks layers 4..5" in n for n in cm.notes)
    # the calibrated efficiency came from the measured blocks, not the datasheet default
    assert d.efficiency != MIXED.device_type("A100-80GB").efficiency


def test_a_profile_measured_tensor_parallel_replaces_the_analytic_terms_at_its_degree():
    m = builtin_model("gpt-tiny")
    whole = _profile(m, "A100-80GB", range(6), ms=1.0)
    cm = CostModel(MIXED, m, profiles=[whole, _profile(m, "A100-80GB", range(1, 3), ms=0.7, tp=2)])
    analytic = CostModel(MIXED, m, profiles=[whole])
    fwd2, bwd2, _, _ = cm.layer_times("A100-80GB", 2)
    assert fwd2[1] == pytest.approx(0.7e-3 / 2) and bwd2[2] == pytest.approx(1.4e-3 / 2)  # measured at t = 2
    # blocks it lacks, and other degrees, keep the analytic terms on top of the t = 1 profile
    assert fwd2[3] == analytic.layer_times("A100-80GB", 2)[0][3]
    assert cm.layer_times("A100-80GB", 4)[0][1] == analytic.layer_times("A100-80GB", 4)[0][1]
    assert cm.layer_times("A100-80GB", 1)[0][1] == pytest.approx(1e-3 / 2)  # t = 1 untouched
    assert cm.tp_measured("A100-80GB", 2) and not cm.tp_measured("A100-80GB", 4)
    with pytest.raises(ValueError, match=r"tensor_parallel: 3 must divide the model's attention heads"):
        _profile(m, "A100-80GB", range(6), tp=3)


def test_a_tensor_parallel_profile_faster_than_the_link_figure_keeps_its_weight_pass_positive():
    """A profile measured at TP 2 holds its all-reduces; where the cluster's intra-node figure prices them above
    the measured backward (Sailor's A100-40GB profile at TP 2 against 14 Gbit/s), the backward's compute is the
    unsplit one divided by the degree, at most the measured one. Before, the weight pass came out negative and
    a zb-v plan's pass times failed validation."""
    from hethub.partitioner.costmodel import backward_compute_s, pass_times_s
    m = builtin_model("gpt-tiny")
    slow = Cluster.model_validate({"nodes": [{"host": "a", "device_type": "A100-80GB", "count": 4}],
                                   "network": {"intra_node_gbps": 0.1}})
    t = "A100-80GB"
    one = _profile(m, t, range(6), ms=1.0)
    cm = CostModel(slow, m, profiles=[one, _profile(m, t, range(6), ms=0.01, tp=2)])
    assert (cm.tp_allreduce_s(t, 2)[0][1:5] > cm.layer_times(t, 2)[1][1:5]).all()  # the figure overstates them
    comp_s, _ = backward_compute_s(cm, t, 2)
    assert comp_s[2] == pytest.approx(min(cm.layer_times(t, 1)[1][2] / 2, cm.layer_times(t, 2)[1][2]))
    for first, last in ((0, 6), (1, 3)):
        fwd, inp, wgt = pass_times_s(cm, t, first, last, 2, False, 2, True)
        assert fwd > 0 and inp > 0 and wgt > 0
        assert inp + wgt == pytest.approx(sum(cm.stage_compute_s(t, first, last, 2, False, 2)[1:]))


def test_a_measured_split_backward_prices_zero_bubble_passes_and_the_analytic_share_stays_elsewhere():
    """B + W of a split backward cost more than one backward (each pass's own fixed costs): where a profile
    measured both passes, the weight pass is the measured one and the input pass carries the difference, in
    the cost model, the planner's closed form and the simulator alike; elsewhere the analytic share applies."""
    m = builtin_model("gpt-tiny")
    plain = _profile(m, "A100-80GB", range(6))  # forward 1 ms, backward 2 ms, at micro-batch 2
    data = plain.model_dump()
    for lp in data["layers"][1:]:  # 2 ms of backward run split as 1.6 + 1.0 ms
        lp.update(input_grad_ms=1.6, weight_grad_ms=1.0)
    split = Profile.model_validate(data)
    cm, ref = CostModel(MIXED, m, profiles=[split]), CostModel(MIXED, m, profiles=[plain])
    t = "A100-80GB"
    assert cm.stage_weight_grad_s(t, 1, 5, 2) == pytest.approx(4 * 1.0e-3)
    assert cm.stage_split_extra_s(t, 1, 5, 2) == pytest.approx(4 * 0.6e-3)
    assert cm.stage_split_extra_s(t, 0, 1, 2) == 0.0  # the embedding: not measured split
    share = float(ref.layers.wgrad_share[2])
    assert ref.stage_weight_grad_s(t, 2, 3, 2) == pytest.approx(share * 2e-3) and ref.stage_split_extra_s(t, 1, 5, 2) == 0
    plan = build_plan(m, MIXED, [StageLayout((0, 3), t, (2,)), StageLayout((3, 6), t, (2,))], 2, 4)
    zb = plan.model_copy(update={"schedule": "zb-h1"})
    # stage 1 splits its backward: its B takes input_grad_ms per layer, its W weight_grad_ms
    events = [e for e in simulate(zb, cm).events if e.rank == 1 and e.kind in ("B", "W")]
    assert {round((e.end_s - e.start_s) * 1e3, 6) for e in events if e.kind == "B"} == {round(3 * 1.6, 6)}
    assert {round((e.end_s - e.start_s) * 1e3, 6) for e in events if e.kind == "W"} == {round(3 * 1.0, 6)}
    assert stage_costs(zb, cm)[1].compute_s == pytest.approx(stage_costs(zb, ref)[1].compute_s + 3 * 0.6e-3)
    assert stage_costs(plan, cm)[1].compute_s == pytest.approx(stage_costs(plan, ref)[1].compute_s)  # 1f1b: fused
    with pytest.raises(ValueError, match=r"input_grad_ms: a split backward is measured as both passes"):
        LayerProfile(index=1, kind="block", forward_ms=1, backward_ms=2, input_grad_ms=1.0)


def test_profile_for_unknown_type_or_other_model_is_refused():
    m = builtin_model("gpt-tiny")
    with pytest.raises(InputError, match=r"profiles\[0\].device_type: profile is for 'H100-80GB'"):
        CostModel(MIXED, m, profiles=[_profile(m, "H100-80GB", range(6))])
    other = builtin_model("gpt-125m")
    with pytest.raises(InputError, match=r"profiles\[0\].model: profile was measured on model 'gpt-125m'"):
        CostModel(MIXED, m, profiles=[_profile(other, "A100-80GB", range(6))])


def test_calibration_recovers_a_known_efficiency():
    m = builtin_model("gpt-125m")
    costs = layer_costs(m)
    peak = 100.0
    measured = {i: 3 * costs.flops_fwd[i] * 4 / (peak * 1e12 * 0.37) * 1e3 for i in range(1, m.num_planner_layers)}
    assert calibrate_efficiency(m, peak, measured, 4) == pytest.approx(0.37)


def test_profiler_measures_every_layer_and_round_trips(tmp_path):
    pytest.importorskip("torch")
    from conftest import run_cli
    out = tmp_path / "p.json"
    r = run_cli("profile", "--model", "gpt-tiny", "--device-type", "CPU", "--reps", "2", "-o", str(out))
    assert r.returncode == 0, r.stderr
    for kind in ("embedding", "block", "head"):  # each layer's spread, said and recorded
        assert re.search(rf"^{kind}: forward [\d.]+ ms, backward [\d.]+ ms, spread \d+%", r.stdout, re.M), r.stdout
    from hethub.partitioner import load_profile
    prof = load_profile(str(out))
    assert all(l.spread is not None and 1 <= l.rounds <= 3 for l in prof.layers)
    assert [l.index for l in prof.layers] == list(range(6))
    assert all(l.forward_ms > 0 and l.backward_ms > 0 for l in prof.layers)
    block = prof.layers[1]
    # the split backward (zb-h1, zb-v) measured as its two passes where the input carries a gradient
    assert prof.layers[0].input_grad_ms is None and prof.layers[0].weight_grad_ms is None
    assert all(l.input_grad_ms > 0 and l.weight_grad_ms > 0 for l in prof.layers[1:])
    # between them a block waits with more than its forward left: the graph kept for its norms' weights, and
    # every Linear's output gradient (the head: its logits' gradient, 32 positions x 256 tokens in fp32)
    assert prof.layers[0].weight_pass_bytes is None
    assert all(l.weight_pass_bytes > l.activation_bytes for l in prof.layers[1:-1])
    assert prof.layers[-1].weight_pass_bytes >= 4 * 32 * 256
    # autograd keeps at least the block's input and the MLP's hidden activations (fp32, 1 x 32 x 256)
    assert block.activation_bytes >= 4 * 32 * 256
    r = run_cli("profile", "--model", "gpt-tiny", "--device-type", "CPU", "--reps", "2", "--dtype", "bf16",
                "-o", str(tmp_path / "bf16.json"))
    assert r.returncode == 0, r.stderr
    low = load_profile(str(tmp_path / "bf16.json"))
    # profiled as the runtime trains in bf16: fp32 weights and residual under autocast, whose matmuls keep
    # bf16 copies of their inputs, so the block keeps fewer bytes than in fp32 and more than half (every
    # tensor in bf16, as a profile of a bf16-cast block had it: 0.501 of fp32 here; autocast 0.526)
    assert low.dtype == "bf16" and 0.51 < low.layers[1].activation_bytes / block.activation_bytes < 0.9
    r = run_cli("profile", "--model", "gpt-tiny", "--device-type", "CPU", "--micro-batch-size", "0")
    assert r.returncode == 2 and r.stderr.strip() == "error: --micro-batch-size: must be in 1..65536, got 0"
    r = run_cli("profile", "--model", "gpt-tiny", "--device-type", "CPU", "--tensor-parallel", "2")
    assert r.returncode == 2 and r.stderr.strip() == ("error: --tensor-parallel: 2 needs 2 processes under a "
                                                      "launcher (e.g. torchrun --nproc-per-node 2), got WORLD_SIZE 1")


@pytest.mark.dist
def test_profile_tensor_parallel_splits_the_block_over_the_launched_processes(tmp_path):
    """``hethub profile --tensor-parallel 2`` under 2 processes: the block runs split (its all-reduces are in
    its time), embedding and head whole; the planner's cost model then prices t = 2 from it."""
    pytest.importorskip("torch")
    from dist_util import spawn
    out = tmp_path / "p2.json"
    argv = ["-m", "hethub.cli", "profile", "--model", "gpt-tiny", "--device-type", "A100-80GB", "--reps", "2",
            "--tensor-parallel", "2", "-o", str(out)]
    for rank, (rc, _o, err) in enumerate(spawn(2, argv, timeout=120)):
        assert rc == 0, f"rank {rank}: {err[-2000:]}"
    from hethub.partitioner import load_profile
    prof = load_profile(str(out))
    assert prof.tensor_parallel == 2 and [l.index for l in prof.layers] == list(range(6))
    # half the block's weights per rank: the activations it keeps (the MLP's hidden half) shrink too
    whole = run_cli_profile(tmp_path)
    assert prof.layers[1].activation_bytes < whole.layers[1].activation_bytes
    assert prof.layers[0].activation_bytes == whole.layers[0].activation_bytes  # the embedding runs whole
    cm = CostModel(MIXED, prof.model, profiles=[whole, prof])
    assert cm.layer_times("A100-80GB", 2)[0][1] == pytest.approx(prof.layers[1].forward_ms / 1e3)


def run_cli_profile(tmp_path):
    from conftest import run_cli

    from hethub.partitioner import load_profile
    r = run_cli("profile", "--model", "gpt-tiny", "--device-type", "A100-80GB", "--reps", "2", "-o",
                str(tmp_path / "p1.json"))
    assert r.returncode == 0, r.stderr
    return load_profile(str(tmp_path / "p1.json"))


def test_a_stage_marked_zero1_is_priced_as_sharded_and_the_others_are_not():
    """A plan's stage with ``zero1``: its memory, all-reduce (+ all-gather) and optimizer step are plan-wide
    ZeRO-1's figures; the other stages keep unsharded ones; the weight-gradient share splits backward."""
    from hethub.partitioner.evaluate import stage_costs
    from hethub.partitioner.placement import StageLayout, build_plan
    two = Cluster.model_validate({"name": "two", "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 8}]})
    model = builtin_model("gpt-1.3b")
    lay = [StageLayout((0, 10), "A100-80GB", (2, 2)), StageLayout((10, 26), "A100-80GB", (2, 2), zero1=True)]
    plan = build_plan(model, two, lay, 4, 8)
    assert [st.zero1 for st in plan.stages] == [False, True]
    plain, shard = CostModel(two, model), CostModel(two, model, zero1=True)
    unmarked = plan.model_copy(update={"stages": [st.model_copy(update={"zero1": False}) for st in plan.stages]})
    got, none, every = stage_costs(plan, plain), stage_costs(unmarked, plain), stage_costs(unmarked, shard)
    assert got[0] == none[0] and got[1] == every[1] and got[1] != none[1]
    assert got[1].memory_bytes < none[1].memory_bytes and got[1].allreduce_s > none[1].allreduce_s
    assert got[1].optimizer_s < none[1].optimizer_s
    fwd, bwd = plain.stage_compute_s("A100-80GB", 10, 26, 2)
    assert 0.3 * bwd < plain.stage_weight_grad_s("A100-80GB", 10, 26, 2) < 0.6 * bwd


def _bucket_pipeline_end(a, n, ends, hides):
    """Brute force of the bucketed all-reduce: bucket k is ready once every replica's last gradient pass has
    filled it (evenly, in order); buckets run one after another, a/n each."""
    t = -math.inf
    for k in range(n):
        ready = max(e - h + h * (k + 1) / n for e, h in zip(ends, hides))
        t = max(t, ready) + a / n
    return t


def test_bucketed_allreduce_ends_as_a_brute_force_of_its_buckets_does():
    assert allreduce_end_s(4.0, 4, [0.0], [0.0]) == pytest.approx(4.0)  # nothing to hide behind
    assert allreduce_end_s(4.0, 4, [0.0], [8.0]) == pytest.approx(1.0)  # all but the last bucket hidden
    assert allreduce_end_s(4.0, 4, [0.0], [2.0]) == pytest.approx(2.5)
    assert allreduce_end_s(4.0, 1, [0.0], [8.0]) == pytest.approx(4.0)  # one bucket: after the backward
    rng = random.Random(7)
    for _ in range(300):
        q, n, a = rng.randint(1, 4), rng.randint(1, 12), rng.uniform(0.1, 5)
        ends = [rng.uniform(0, 3) for _ in range(q)]
        hides = [rng.uniform(0, 6) for _ in range(q)]
        assert float(allreduce_end_s(a, n, ends, hides)) == pytest.approx(_bucket_pipeline_end(a, n, ends, hides))


def test_sync_prices_fp32_gradients_in_buckets_and_hides_them_behind_the_backward():
    cm = CostModel(MIXED, builtin_model("gpt-1.3b"))
    p = 100 * 2 ** 20 / 4  # 100 MiB of fp32 gradients: four 25 MiB buckets
    assert cm.num_buckets(p) == 4
    full = cm.sync_s(p, ["A100-80GB"], 4, False)
    assert cm.sync_s(p, ["A100-80GB"], 4, False, hide_s=10 * full) == pytest.approx(full / 4)
    assert cm.sync_s(p, ["A100-80GB"], 4, False, hide_s=full / 2) == pytest.approx(full - full / 2 * 3 / 4)
    big = CostModel(MIXED, builtin_model("gpt-1.3b"), bucket_mb=1000.0)
    one_bucket = big.sync_s(p, ["A100-80GB"], 4, False)
    assert one_bucket < full  # three fewer ring latencies
    assert big.sync_s(p, ["A100-80GB"], 4, False, hide_s=10 * full) == pytest.approx(one_bucket)
    # ZeRO-1's all-gather comes after the step: never hidden
    z = CostModel(MIXED, builtin_model("gpt-1.3b"), zero1=True)
    gather = z.sync_s(p, ["A100-80GB"], 4, False) - full
    assert gather > 0
    assert z.sync_s(p, ["A100-80GB"], 4, False, hide_s=10 * full) == pytest.approx(gather + full / 4)


def test_the_natural_dtype_is_the_cheapest_every_type_computes_and_the_plan_records_it():
    """bf16 where every type has it; a V100 among them makes it fp16 (bf16 there would run at the fp32 peak,
    8x below what the plan would assume); the dtype reaches the plan, and the cost model prices it."""
    from hethub.partitioner.costmodel import natural_dtype
    from hethub.partitioner.api import make_plan
    from hethub.partitioner.planner import PlannerOptions
    a100 = Cluster.model_validate({"name": "a", "nodes": [{"host": "h0", "device_type": "A100-80GB", "count": 2}]})
    assert natural_dtype(a100) == ("bf16", "every device type computes bf16")
    assert natural_dtype(MIXED)[0] == "fp16" and "V100" in natural_dtype(MIXED)[1]
    assert natural_dtype(MIXED, ["A100-80GB"])[0] == "bf16"
    cpu = Cluster.model_validate({"name": "c", "device_types": {"C": {"vendor": "cpu", "peak_tflops": {"fp32": 1},
                                  "memory_gib": 8, "memory_gbps": 20}},
                                  "nodes": [{"host": "h0", "device_type": "C", "count": 2}]})
    assert natural_dtype(cpu) == ("fp32", "no bf16 on C, no fp16 on C")
    m = builtin_model("gpt-125m")
    bf16, fp16 = CostModel(MIXED, m, dtype="bf16"), CostModel(MIXED, m, dtype="fp16")
    v100 = next(t for t in MIXED.type_names if t.startswith("V100"))
    assert bf16.devices[v100].fwd_s[1] > 5 * fp16.devices[v100].fwd_s[1]  # a block, per sample
    plan = make_plan(MIXED, m, 16, cost_model=fp16, with_homogeneous_sum=False,
                     opts=PlannerOptions(time_limit_s=5))
    assert plan.dtype == "fp16" and type(plan).from_json(plan.to_json()).dtype == "fp16"


def test_upper_bound_holds_when_layer_speed_ratios_differ():
    """Two types, each twice as fast as the other on half the layers: each device alone runs a sample in
    3 s, but splitting the layers runs 2 samples in 2 x 2 s of device time (1 sample/s per device pair)."""
    layer_s = {"A": np.array([1.0, 2.0]), "B": np.array([2.0, 1.0])}
    alone = 1 / 3 + 1 / 3
    bound = work_bound_samples_per_s(layer_s, {"A": 1, "B": 1})
    assert bound == pytest.approx(1.0, rel=1e-6) and bound > alone
    # proportional ratios: the bound is the old sum exactly
    same = {"A": np.array([1.0, 2.0]), "B": np.array([2.0, 4.0])}
    assert work_bound_samples_per_s(same, {"A": 2, "B": 1}) == pytest.approx(2 / 3 + 1 / 6, rel=1e-6)


def test_a_layer_whose_repetitions_spread_wide_is_measured_again_and_the_steadiest_round_kept():
    pytest.importorskip("torch")
    from hethub.cli.profiler import MAX_ROUNDS, SPREAD_LIMIT, measure_steady, spread
    assert spread([1.0] * 9) == 0.0
    assert spread([1.0] * 9 + [5.0]) == 0.0  # one slow repetition in ten: the median already ignores it
    assert spread([1.0] * 8 + [5.0, 5.0]) == pytest.approx(4.0)  # two: the layer's time is not steady
    for spreads, kept, rounds in (([0.1], 0.1, 1), ([0.9, 0.5, 0.1], 0.1, 3), ([0.9, 0.1], 0.1, 2),
                                  ([0.9, 0.8, 0.95], 0.8, MAX_ROUNDS)):
        it = iter(spreads)
        got = measure_steady(lambda: {"spread": next(it), "forward_ms": 1.0})
        assert (got["spread"], got["rounds"]) == (kept, rounds), spreads
    assert SPREAD_LIMIT < 0.5
