"""--what-if, --objective cost ($ per 1M tokens) and --explain."""
import json
import re

import pytest

from hethub.partitioner import Cluster, InputError, ModelConfig, builtin_model
from hethub.partitioner.api import make_plan, solve, type_subsets
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.explain import explain
from hethub.partitioner.planner import PlannerOptions
from hethub.partitioner.whatif import apply_what_if

PRICED = {"name": "priced", "device_types": {"A100-80GB": {"usd_per_hour": 1.8}, "V100-32GB": {"usd_per_hour": 0.9}},
          "nodes": [{"host": "a0", "device_type": "A100-80GB", "count": 4},
                    {"host": "v0", "device_type": "V100-32GB", "count": 4},
                    {"host": "v1", "device_type": "V100-32GB", "count": 4}],
          "network": {"intra_node_gbps": {"A100-80GB": 2400, "V100-32GB": 1200}, "inter_node_gbps": 200}}
# a limit every search here finishes well within (the slowest proves its plan optimal in about 4 s): plans, and the
# comparisons between them, must not depend on how fast the machine running the tests is
OPTS = PlannerOptions(time_limit_s=60, max_micro_batch_size=16)


def test_what_if_sentences_change_the_cluster():
    cl = Cluster.model_validate(PRICED)
    more = apply_what_if(cl, "add 6 A100-80GB")
    assert more.count_by_type() == {"A100-80GB": 10, "V100-32GB": 8}
    assert [(n.host, n.count) for n in more.nodes[-2:]] == [("whatif-A100-80GB-0", 4), ("whatif-A100-80GB-1", 2)]
    new_type = apply_what_if(cl, "add 8 H100-80GB; remove host v1")
    assert new_type.count_by_type() == {"A100-80GB": 4, "V100-32GB": 4, "H100-80GB": 8}
    assert new_type.network.intra_gbps("H100-80GB") == 1200  # the slowest listed link, never optimistic
    fewer = apply_what_if(cl, "remove 5 V100-32GB")
    assert [(n.host, n.count) for n in fewer.nodes] == [("a0", 4), ("v0", 3)]  # last nodes first
    for text, message in (("add 3 B200", "unknown device type 'B200'"), ("remove host x9", "no host 'x9'"),
                          ("remove 9 V100-32GB", "the cluster has 8 V100-32GB devices"),
                          ("double everything", "expected 'add N TYPE'"),
                          ("remove 4 A100-80GB; remove 8 V100-32GB", "leaves no devices")):
        with pytest.raises(InputError, match=message) as exc:
            apply_what_if(cl, text)
        assert exc.value.field == "--what-if"


def test_dollars_per_million_tokens_and_the_cost_objective():
    cl = Cluster.model_validate(PRICED)
    model = builtin_model("gpt-1.3b")
    cm = CostModel(cl, model)
    fast = make_plan(cl, model, 64, opts=OPTS, cost_model=cm, with_homogeneous_sum=False)
    used = fast.devices_by_type()
    hourly = 1.8 * used.get("A100-80GB", 0) + 0.9 * used.get("V100-32GB", 0)
    expected = hourly * fast.predicted.iteration_s / 3600 / (64 * model.seq_length) * 1e6
    assert fast.predicted.usd_per_million_tokens == pytest.approx(expected)
    cheap = make_plan(cl, model, 64, opts=OPTS, cost_model=cm, with_homogeneous_sum=False, objective="cost")
    # the cheapest over which types to rent: no dearer than the fastest plan or any single type's plan
    singles = [solve(cm, 64, PlannerOptions(**{**OPTS.__dict__, "device_types": (t,)})) for t in cl.type_names]
    assert all(cheap.predicted.usd_per_million_tokens <= p.predicted.usd_per_million_tokens * (1 + 1e-9)
               for p in [fast, *singles])
    # what each set of types would cost, all of them included, is said beside the cheapest (written: *)
    from hethub.cli.plan import cost_lines
    lines = cost_lines(cheap)
    assert len(lines) == 1 + 3 and lines[1].startswith("* ")
    assert re.search(r"^  A100-80GB \+ V100-32GB: \$[\d.]+ at [\d,.]+ samples/s$", "\n".join(lines), re.M), lines
    assert cost_lines(fast) == []
    assert type_subsets(["a", "b"]) == [("a",), ("b",), ("a", "b")]
    assert len(type_subsets(list("abcdef"))) == 6 + 1 + 6
    unpriced = CostModel(Cluster.model_validate({**PRICED, "device_types": {}}), model)
    with pytest.raises(InputError, match=r"cost needs usd_per_hour for every device type; 'A100-80GB' has none"):
        make_plan(unpriced.cluster, model, 64, opts=OPTS, cost_model=unpriced, objective="cost")


def test_explain_names_the_constraint_and_what_brings_idle_devices_in():
    # 32 A100s for a global batch of 2 (with 4 A100s one stage of two tensor-parallel replicas is best: the
    # V100s are then idle for the bound, not the batch)
    cl = Cluster.model_validate({**PRICED, "nodes": [{"host": f"a{i}", "device_type": "A100-80GB", "count": 4}
                                                     for i in range(8)] + PRICED["nodes"][1:]})
    cm = CostModel(cl, builtin_model("gpt-1.3b"))
    plan = make_plan(cl, cm.model, 2, opts=OPTS, cost_model=cm, with_homogeneous_sum=False)
    lines = explain(plan, cm, OPTS, solve)
    idle = [line for line in lines if "idle" in line]
    assert idle, lines
    # a global batch of 2 gives each stage at most 2 replicas: that is what keeps the rest out
    assert any("batch: a replica needs at least one of the micro-batch's" in line for line in idle), idle
    assert any(re.search(r"global batch (4|8|16) would use \d+ of them: \+", line) for line in idle), idle
    # memory: a model whose block does not fit one device of a type even split 4 ways (V100, 32 GiB)
    huge = ModelConfig(name="huge", architecture="gpt", num_layers=2, hidden_size=32768, num_attention_heads=64,
                       ffn_hidden_size=131072, vocab_size=1000, seq_length=128)
    big = CostModel(cl, huge)
    from hethub.partitioner.explain import idle_reason
    assert idle_reason(plan, big, "V100-32GB", 8).startswith("memory: one block split")


def test_the_cli_prints_the_what_if_and_writes_no_plan(tmp_path):
    from conftest import run_cli
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps(PRICED))
    out = tmp_path / "plan.json"
    r = run_cli("plan", "--cluster", str(cluster), "--model", "gpt-1.3b", "--global-batch", "64", "--time-limit",
                "3", "--max-micro-batch", "16", "-o", str(out), "--what-if", "remove host v1")
    assert r.returncode == 0, r.stderr
    assert "what-if 'remove host v1':" in r.stdout and "samples/s (" in r.stdout and not out.exists()
    r = run_cli("plan", "--cluster", str(cluster), "--model", "gpt-1.3b", "--global-batch", "64", "-o", str(out),
                "--what-if", "add 2")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --what-if: 'add 2': expected") and not out.exists()


def test_layer_granularity_is_the_best_balance_of_cuts_inside_layers():
    """``granularity.fractional_pace_s``: two groups, the second at half speed, four equal layers: cut between
    layers the busiest does 3 units (3 + 1 layers: 3 and 2); cut anywhere, 8/3 (2 2/3 layers on the first). On
    random instances never above the best cut between layers (brute force), and equal to it where the layers
    divide evenly over groups of one speed."""
    import itertools
    import random

    import numpy as np

    from hethub.partitioner.granularity import fractional_pace_s

    def prefix(costs):
        return np.array([np.concatenate([[0.0], np.cumsum(c)]) for c in costs])

    assert fractional_pace_s(prefix([[1.0] * 4, [2.0] * 4])) == pytest.approx(8 / 3)
    assert fractional_pace_s(prefix([[1.0] * 6] * 3)) == pytest.approx(2.0)
    rng = random.Random(3)
    for _ in range(100):
        p, n = rng.randint(1, 4), rng.randint(4, 9)
        costs = [[rng.uniform(0.2, 3.0) for _ in range(n)] for _ in range(p)]
        pre = prefix(costs)
        best = min(max(pre[g][b] - pre[g][a] for g, (a, b) in enumerate(zip((0, *cuts), (*cuts, n))))
                   for cuts in itertools.combinations_with_replacement(range(n + 1), p - 1))
        got = fractional_pace_s(pre)
        assert got <= best * (1 + 1e-9)
        assert got >= np.min(costs, axis=0).sum() / p * (1 - 1e-9)  # each layer at its cheapest, spread evenly


def test_explain_says_what_whole_layers_cost_the_plan():
    """8 A100 + 8 V100 (gpt-1.3b): the plan's busiest group and the balance its groups would reach with cuts
    inside layers, and the samples/s that is worth; a chunked plan and a one-stage plan get no such line."""
    from hethub.partitioner.chunked import rechunk
    from hethub.partitioner.evaluate import chunk_time_s
    from hethub.partitioner.granularity import granularity, granularity_line, group_prefix_s
    from instances import TWO_TYPE
    model = builtin_model("gpt-1.3b")
    cm = CostModel(TWO_TYPE, model, dtype="fp16")
    plan = make_plan(TWO_TYPE, model, 128, opts=OPTS, cost_model=cm, with_homogeneous_sum=False)
    chunk_s = chunk_time_s(plan, cm)  # the vectorized prefixes price a range as the planner does
    n = cm.model.num_planner_layers
    assert group_prefix_s(plan, cm).ravel() == pytest.approx(
        [chunk_s(g, 0, k) for g in range(plan.num_stages) for k in range(n + 1)], rel=1e-12)
    planned, fractional, iteration_s = granularity(plan, cm)
    assert 0.9 * planned < fractional < planned and iteration_s < plan.predicted.iteration_s
    line = granularity_line(plan, cm)
    assert line in explain(plan, cm, OPTS, solve)
    assert re.search(r"busiest group computes [\d.]+ ms per micro-batch; .* balance at [\d.]+ ms, about "
                     r"\d+\.\d% more samples/s", line), line
    assert granularity_line(rechunk(plan, "interleaved-1f1b", 2).model_copy(update={"predicted": plan.predicted}),
                            cm) is None
    one = make_plan(TWO_TYPE, model, 128, opts=PlannerOptions(**{**OPTS.__dict__, "device_types": ("A100-80GB",)}),
                    cost_model=cm, with_homogeneous_sum=False)
    assert one.num_stages == 1 and granularity_line(one, cm) is None
