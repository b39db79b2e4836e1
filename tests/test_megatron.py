"""Plans for Megatron: --equal-widths, `hethub export megatron`, and megatron-core accepting the export."""
import os

import pytest

from conftest import EXAMPLES, run_cli
from dist_util import spawn
from hethub.partitioner import Cluster, InputError, ModelConfig, builtin_model, load_plan
from hethub.partitioner.api import make_plan
from hethub.partitioner.megatron_export import export_megatron
from hethub.partitioner.placement import StageLayout, build_plan
from hethub.partitioner.planner import PlannerOptions

TWO_TYPE = Cluster.model_validate({
    "name": "a100-v100", "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 8},
                                   {"host": "v", "device_type": "V100-32GB", "count": 8}]})


def test_equal_widths_plan_and_export():
    plan = make_plan(TWO_TYPE, builtin_model("gpt-1.3b"), 64, opts=PlannerOptions(equal_widths=True),
                     with_homogeneous_sum=False)
    assert len({s.width for s in plan.stages}) == 1
    assert all(len({r.samples for r in s.replicas}) == 1 for s in plan.stages)
    ex = export_megatron(plan)
    assert ex.pipeline_model_parallel_size == plan.num_stages
    assert ex.micro_batch_size * ex.data_parallel_size == plan.micro_batch_size
    assert ex.layout.count("|") == plan.num_stages - 1 and ex.layout.startswith("E") and ex.layout.endswith("L")
    free = make_plan(TWO_TYPE, builtin_model("gpt-1.3b"), 64, with_homogeneous_sum=False,
                     opts=PlannerOptions(max_tensor_parallel=1))  # the same space but for equal widths
    assert free.predicted.samples_per_s >= plan.predicted.samples_per_s * (1 - 1e-9)  # a restriction costs


def test_export_carries_zero1_recompute_dtype_and_each_replicas_type():
    """Before: a plan that needs ZeRO-1 to fit exported no distributed-optimizer flag, recompute was dropped,
    and a mixed stage's V100 replica was listed as the stage's A100."""
    plan = make_plan(TWO_TYPE, builtin_model("gpt-1.3b"), 64, opts=PlannerOptions(equal_widths=True),
                     with_homogeneous_sum=False)
    first = plan.stages[0]
    odd = first.replicas[-1].model_copy(update={"device_type": "V100-32GB"})
    first = first.model_copy(update={"zero1": True, "recompute": True, "replicas": [*first.replicas[:-1], odd]})
    ex = export_megatron(plan.model_copy(update={"stages": [first, *plan.stages[1:]], "dtype": "fp16"}))
    flags = ex.flags()
    assert {"--use-distributed-optimizer", "--recompute-granularity full", "--fp16"} <= set(flags)
    if plan.num_stages > 1:
        assert any("recomputes on stages [0] only" in n for n in ex.notes())
    dp = ex.data_parallel_size
    assert [row[5] for row in ex.rank_order[:dp]] == [*[first.device_type] * (dp - 1), "V100-32GB"]
    plain = export_megatron(plan)
    assert not {"--use-distributed-optimizer", "--recompute-granularity full"} & set(plain.flags())


def test_plans_megatron_cannot_express_are_refused_with_the_reason():
    with pytest.raises(InputError, match=r"stage widths \[2, 3, 4\] differ.*hethub's runtime"):
        export_megatron(load_plan(os.path.join(EXAMPLES, "plan.json")))
    r = run_cli("export", "megatron", os.path.join(EXAMPLES, "plan.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1


@pytest.mark.dist
def test_megatron_core_accepts_the_export(tmp_path):
    pytest.importorskip("megatron.core")
    cl = Cluster.model_validate({"name": "cpu", "device_types": {"CPU": {"vendor": "cpu", "peak_tflops": 1,
                                                                         "memory_gib": 4, "memory_gbps": 10}},
                                 "nodes": [{"host": "localhost", "device_type": "CPU", "count": 4}]})
    m = ModelConfig(name="m", architecture="gpt", num_layers=5, hidden_size=32, num_attention_heads=4,
                    ffn_hidden_size=64, vocab_size=64, seq_length=8)
    plan = build_plan(m, cl, [StageLayout((0, 2), "CPU", (2, 2)), StageLayout((2, 7), "CPU", (2, 2))], 4, 2)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert export_megatron(plan).layout == "Et|t*4L"
    results = spawn(4, [os.path.join("tests", "workers", "megatron_accept.py"), str(path)], timeout=120)
    for rc, out, err in results:
        assert rc == 0 and "ok" in out, err[-2000:]


@pytest.mark.dist
def test_megatron_core_layers_tensor_parallel_match_one_process(tmp_path):
    """A tiny Llama-style megatron-core GPT (local spec; SwiGLU, 2 query groups) under width 1 -> tensor
    parallel 2 x width 2 (4+2 samples, recompute) trains like one process (5 SGD steps, clipped): megatron-core's
    own parallel layers over each replica's group, under activation checkpointing."""
    pytest.importorskip("megatron.core")
    import sys

    import torch

    from conftest import ROOT
    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    from hethub.models.megatron import model_config_from_megatron
    from train_megatron import SEQ, VOCAB, megatron_config
    model = model_config_from_megatron(megatron_config(), VOCAB, SEQ, name="megatron-tiny")
    assert model.num_planner_layers == 5 and model.architecture == "llama"
    cl = Cluster.model_validate({"name": "cpu", "device_types": {"CPU": {"vendor": "cpu", "peak_tflops": 1,
                                                                         "memory_gib": 4, "memory_gbps": 10}},
                                 "nodes": [{"host": "localhost", "device_type": "CPU", "count": 5}]})
    plan = build_plan(model, cl, [StageLayout((0, 2), "CPU", (6,)),
                                  StageLayout((2, 5), "CPU", (4, 2), tensor_parallel=2, recompute=True)], 6, 2)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    worker = os.path.join("tests", "workers", "train_megatron.py")
    results = spawn(5, [worker, str(path), str(tmp_path / "r{rank}.pt"), "5"], timeout=150)
    for rank, (rc, _o, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {err[-3000:]}"
    (rc, _out, err), = spawn(1, [worker, str(path), str(tmp_path / "single.pt"), "5", "single"], timeout=120)
    assert rc == 0, err[-3000:]
    ref = torch.load(tmp_path / "single.pt", weights_only=True)
    seen, splits = set(), []
    for rank in range(5):
        got = torch.load(tmp_path / f"r{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)
        splits.append(int(got["split"]))
        for k, v in got["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=0, atol=1e-5)
            seen.add(k)
    assert seen == set(ref["params"]) and ref["losses"][-1] < ref["losses"][0]
    # each of the 4 ranks of stage 1 holds a shard of 6 tensors per block (QKV and fc1 weight and bias,
    # both output projections' weights) for its 2 blocks; the width-1 stage splits nothing
    assert sorted(splits) == [0, 12, 12, 12, 12], splits


def test_cost_model_reads_a_megatron_config():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hethub.models.megatron import model_config_from_megatron
    from hethub.partitioner.costmodel import layer_costs
    tc = TransformerConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                           ffn_hidden_size=14336, gated_linear_unit=True, normalization="RMSNorm",
                           use_cpu_initialization=True)
    m = model_config_from_megatron(tc, 128256, 8192, name="llama-3-8b")
    assert m.architecture == "llama" and m.kv_heads == 8
    assert layer_costs(m).params.sum() / 1e9 == pytest.approx(8.03, rel=0.01)  # Llama-3-8B: 8.03B


def _equal_plan(model_name="gpt-1.3b", schedule=None):
    plan = make_plan(TWO_TYPE, builtin_model(model_name), 64, opts=PlannerOptions(equal_widths=True),
                     with_homogeneous_sum=False)
    return plan if schedule is None else plan.model_copy(update={"schedule": schedule})


def test_chunked_plans_export_as_megatrons_virtual_pipeline_and_zb_v_is_refused():
    from hethub.partitioner.chunked import rechunk
    from instances import stack_plan
    base = stack_plan([3], [[2, 2], [2, 2]], 4, 4)  # equal widths, even splits, one host
    inter = export_megatron(rechunk(base, "interleaved-1f1b", 2))
    assert inter.virtual_stages == 2 and inter.layout.count("|") == 2 * 2 - 1 and inter.first_last is None
    assert inter.layout.startswith("E") and inter.layout.endswith("L")
    assert any("virtual pipeline" in n for n in inter.notes())
    with pytest.raises(InputError, match="plan.schedule: zb-v .* has no Megatron flags"):
        export_megatron(rechunk(base, "zb-v", 2))
    zb = export_megatron(base.model_copy(update={"schedule": "zb-h1"}))
    assert any(n.startswith("schedule zb-h1: Megatron runs these flags as 1F1B") for n in zb.notes())


def test_the_first_last_alternative_only_where_megatron_accepts_it_and_the_models_shape_is_emitted():
    from instances import CPU_CLUSTER, STACK
    only_embedding = build_plan(STACK, CPU_CLUSTER, [StageLayout((0, 1), "CPU", (2, 2)),
                                                     StageLayout((1, 7), "CPU", (2, 2))], 4, 2)
    assert export_megatron(only_embedding).first_last is None  # Megatron: first stage layers must be > 0
    llama = builtin_model("llama-7b").model_copy(update={"num_key_value_heads": 8})
    flags = export_megatron(build_plan(llama, CPU_CLUSTER, [StageLayout((0, 17), "CPU", (1,)),
                                                            StageLayout((17, 34), "CPU", (1,))], 1, 2)).flags()
    for want in ("--hidden-size 4096", "--num-attention-heads 32", "--group-query-attention", "--num-query-groups 8",
                 "--swiglu", "--normalization RMSNorm", "--position-embedding-type rope", "--seq-length",
                 "--vocab-size", "--untie-embeddings-and-output-weights"):
        assert any(f.startswith(want) for f in flags), want


def test_a_rank_order_torchrun_cannot_give_is_refused():
    """Stages alternating hosts (V100 -> A100 -> V100): Megatron's rank order returns to a host."""
    cluster = Cluster.model_validate({"name": "two", "nodes": [{"host": "v", "device_type": "V100-32GB", "count": 4},
                                                               {"host": "a", "device_type": "A100-80GB", "count": 2}]})
    model = builtin_model("gpt-tiny")
    plan = build_plan(model, cluster, [StageLayout((0, 2), "V100-32GB", (4, 4)), StageLayout((2, 4), "A100-80GB", (4, 4)),
                                       StageLayout((4, 6), "V100-32GB", (4, 4))], 8, 2)
    with pytest.raises(InputError, match="on host 'v' again after other hosts: torchrun numbers each node's ranks"):
        export_megatron(plan)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
def test_export_on_every_schedule_and_width_pattern_is_flags_or_one_line(tmp_path, schedule):
    from hethub.partitioner.chunked import rechunk
    from instances import CASES, stack_plan
    for name, case in CASES.items():
        plan = stack_plan(*case)
        plan = rechunk(plan, schedule, 2) if schedule in ("interleaved-1f1b", "zb-v") else plan.model_copy(
            update={"schedule": schedule})
        path = tmp_path / f"{name}.json"
        path.write_text(plan.to_json())
        r = run_cli("export", "megatron", str(path))
        assert r.returncode in (0, 2) and "Traceback" not in r.stderr, (name, r.stderr[-2000:])
        if r.returncode == 2:
            assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (name, r.stderr)
        else:
            assert "--pipeline-model-parallel-layout" in r.stdout, name
