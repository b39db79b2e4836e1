"""The shape MILP (layer-granular planning for models of identical blocks) against the brute-force chain
reference on random small instances, and when the planner chooses it."""
import itertools
import os

import numpy as np
import pytest

from hethub.partitioner import InfeasibleError, builtin_model
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.evaluate import REPLAY_WITHIN
from hethub.partitioner.planner import PlannerOptions, _layer_granular_shapes, micro_batch_sizes, search
from hethub.partitioner.search.candidates import chain_is_feasible, objective_of
from hethub.partitioner.search.shapes import DualBound, ShapeSearch, greedy_shapes, identical_blocks, order_chain
from conftest import EXAMPLES
from instances import TWO_TYPE, random_instance


def one_run_per_vendor(vendors) -> bool:
    runs = [v for k, v in enumerate(vendors) if k == 0 or vendors[k - 1] != v]
    return len(runs) == len(set(runs))


def shape_search_and_brute_force(seed: int):
    """Random instance ``seed``: (cost model, device counts, the finished ShapeSearch, the brute force's best
    chain and stats); the chain and stats are None where no plan exists (the search must then find none)."""
    cluster, model, batch = random_instance(seed)
    cm = CostModel(cluster, model, memory_reserve_gib=0.5)
    if cm.model.num_planner_layers < 4:
        pytest.skip("needs at least two blocks")
    opts = PlannerOptions(max_micro_batch_size=batch, time_limit_s=60)
    types = cluster.type_names
    counts = [cluster.count_by_type()[t] for t in types]
    shapes = ShapeSearch(cm, batch, opts, None, types, counts, micro_batch_sizes(batch, opts))
    shapes.run()
    try:
        ref, ref_stats = search(cm, batch, PlannerOptions(solver="brute-force", max_micro_batch_size=batch,
                                                          time_limit_s=60))
    except InfeasibleError:
        assert shapes.best is None
        return cm, counts, shapes, None, None
    return cm, counts, shapes, ref, ref_stats


def test_the_shape_milp_prices_the_stage_that_crosses_to_another_type_as_its_chain_does(monkeypatch):
    """Where a device type's run of stages ends, the boundary crosses hosts and that stage's pace rises by the
    inter-node price (all of it on the path under ``--network no-overlap``). The shape MILP chooses which stage
    pays it; the bottleneck must hold that stage's raised pace, and the ordered chain must put it last in its
    run. Without both, on 8 A100 + 16 V100 on 25 Gbit/s the MILPs valued their chains up to 42% under the chains'
    own price and the search stopped at a 32% gap; now each chain is priced as its MILP valued it and the search
    proves its plan."""
    from hethub.partitioner import Cluster, ModelConfig
    from hethub.partitioner.search import shapes
    cluster = Cluster.model_validate({"nodes": [{"host": "a0", "device_type": "A100-40GB", "count": 8}]
                                      + [{"host": f"v{i}", "device_type": "V100-16GB", "count": 8} for i in range(2)],
                                      "network": {"inter_node_gbps": 25}})
    model = ModelConfig(name="opt-350m", architecture="gpt", num_layers=24, hidden_size=1024, num_attention_heads=16,
                        ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    priced = []
    solve_counts, order = shapes.ShapeMilp.solve_counts, shapes.order_chain

    def spy_solve(milp, *a, **kw):
        out = solve_counts(milp, *a, **kw)
        priced.append([getattr(milp, "value", None), None])
        return out

    def spy_order(*a):
        res = order(*a)
        if res is not None and priced and priced[-1][0] is not None:
            priced[-1][1] = res[1]
        return res
    monkeypatch.setattr(shapes.ShapeMilp, "solve_counts", spy_solve)
    monkeypatch.setattr(shapes, "order_chain", spy_order)
    _, stats = search(CostModel(cluster, model, dtype="fp16"), 128,
                      PlannerOptions(time_limit_s=60, schedule="1f1b", network="no-overlap"))
    pairs = [(v, got) for v, got in priced if v is not None and got is not None]
    assert pairs and all(got <= v * 1.01 for v, got in pairs)
    assert stats["status"] == "optimal"


@pytest.mark.parametrize("seed", range(30))
def test_shapes_match_brute_force(seed):
    """Single vendor: the same optimum as enumerating every chain. Several vendors: never better than it,
    and the same whenever the best chain visits each vendor in one run (the space the shape MILP covers)."""
    cm, counts, shapes, ref, ref_stats = shape_search_and_brute_force(seed)
    if ref is None:
        return
    got = shapes.best
    assert got is not None
    chain = list(range(len(got.cands)))
    assert chain_is_feasible(got.cands, chain, counts, got.M)
    assert got.objective == pytest.approx(objective_of(got.cands, chain, got.M), rel=1e-12)
    assert got.objective >= ref.objective * (1 - 1e-6)
    ref_vendors = [int(ref.cands.vendor[k]) for k in ref.chosen]
    if one_run_per_vendor(ref_vendors):
        assert got.objective == pytest.approx(ref.objective, rel=1e-6)
    # the time-limit fallback: every greedy plan is a feasible chain, never better than the optimum
    n = cm.model.num_planner_layers
    for b, M, c, t_lb in ((j.b, j.M, j.cand, j.t_lb) for j in shapes.jobs):
        for perm in itertools.permutations(sorted({int(v) for v in c.vendor})):
            for f in ShapeSearch.CAPS:
                plan = greedy_shapes(c, n, counts, M, perm, t_lb * f)
                res = order_chain(c, *plan, perm, n, counts, M) if plan else None
                if res is not None:
                    assert chain_is_feasible(res[0], list(range(len(res[0]))), counts, M)
                    assert res[1] >= ref.objective * (1 - 1e-6)
        # HiGHS stops within its relative MIP gap (1e-4); a slice's shape MILP prices a multiset of stages, which
        # the exact order can cost a little more (seed 10: its bound 0.65% under the optimum the brute force
        # confirms), so the reported gap is that relaxation's, within 1%
        assert shapes.stats()["gap"] <= 1e-2
    # a size's chain the pool holds within the replay window (the simulator replays it) is that size's best
    for alt in ref_stats["alternatives"]:
        held = shapes.pool.get((alt.b,))
        if (held is not None and held.objective <= REPLAY_WITHIN * got.objective
                and one_run_per_vendor([int(alt.cands.vendor[k]) for k in alt.chosen])):
            assert alt.objective * (1 - 1e-6) <= held.objective <= alt.objective * (1 + 1e-2)
    # the dual bound of each size never passes that size's optimum (the brute force's best chain of the size),
    # asked to prove twice the optimum so that it refines as far as it can
    jobs = {j.b: j for j in shapes.jobs}
    for alt in ref_stats["alternatives"]:
        M, c, t_lb = jobs[alt.b].M, jobs[alt.b].cand, jobs[alt.b].t_lb
        assert DualBound(c, n, counts, M, t_lb).bound(2 * alt.objective, 0.05) <= alt.objective * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_slices_halved_after_a_timeout_lose_no_plan(seed, monkeypatch):
    """The search's slices of the bottleneck: when a slice's MILP runs out of time it is halved, and the halves must
    still cover every bottleneck (a bridged stage's pace falls between the shapes' paces). The first four slice
    MILPs of each size are made to time out; the search must still reach the brute force's optimum, and no
    size's bound may pass that size's optimum (over chains visiting each vendor in one run: the MILP's space)."""
    solve, faked = ShapeSearch._solve, {}

    def time_out_first_slices(self, b, M, c, t_lb, cap, seconds, z_lower=None, shape_top=None, cutoff=None):
        if z_lower is not None and faked.get(b, 0) < 4 and shape_top > z_lower:
            faked[b] = faked.get(b, 0) + 1
            self.timeouts += 1
            return 0.0  # what a MILP stopped before any bound says
        return solve(self, b, M, c, t_lb, cap, seconds, z_lower, shape_top, cutoff)

    monkeypatch.setattr(ShapeSearch, "_solve", time_out_first_slices)
    _, _, shapes, ref, ref_stats = shape_search_and_brute_force(seed)
    if ref is None:
        return
    if one_run_per_vendor([int(ref.cands.vendor[k]) for k in ref.chosen]):
        assert shapes.best.objective == pytest.approx(ref.objective, rel=1e-6)
    for alt in ref_stats["alternatives"]:  # each size's best chain, where the shape MILP's space holds it
        if one_run_per_vendor([int(alt.cands.vendor[k]) for k in alt.chosen]):
            assert shapes.bounds[alt.b] <= alt.objective * (1 + 1e-9)


def test_long_models_of_identical_blocks_plan_at_layer_granularity():
    cm = CostModel(TWO_TYPE, builtin_model("llama-140b"))
    assert identical_blocks(cm, TWO_TYPE.type_names, 8)
    assert _layer_granular_shapes(cm, PlannerOptions())
    assert not _layer_granular_shapes(cm, PlannerOptions(max_units=48))  # chunks only when asked
    assert not _layer_granular_shapes(cm, PlannerOptions(solver="brute-force"))
    assert _layer_granular_shapes(CostModel(TWO_TYPE, builtin_model("gpt-1.3b")), PlannerOptions())  # 26 layers
    small = CostModel(TWO_TYPE, builtin_model("gpt-tiny"))  # few layers: the chain MILP, exact over vendor orders
    assert small.model.num_planner_layers <= 16
    assert not _layer_granular_shapes(small, PlannerOptions())


def test_unbounded_knapsack_step_equals_the_loop_it_replaces():
    """``_take_any_number`` (vectorised per residue) against the plain loop g[x] = max(g[x], g[x-d] + m)."""
    from hethub.partitioner.search.shapes import _take_any_number
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        g = rng.integers(0, 20, n).astype(np.int64)
        d, m = int(rng.integers(1, n + 1)), int(rng.integers(0, 9))
        ref = g.copy()
        for x in range(d, n):
            ref[x] = max(ref[x], ref[x - d] + m)
        assert (_take_any_number(g, d, m) == ref).all(), (g, d, m)


def test_bounded_knapsack_step_equals_taking_each_count():
    """``_take_up_to`` (binary splitting) against max over k <= f of g[x - k d] + k m, computed directly."""
    from hethub.partitioner.search.shapes import _take_up_to
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        g = rng.integers(0, 20, n).astype(float)
        d, m, f = int(rng.integers(1, n + 1)), float(rng.integers(0, 9)), int(rng.integers(1, 12))
        ref = np.array([max(g[x - k * d] + k * m for k in range(f + 1) if x - k * d >= 0) for x in range(n)])
        assert (_take_up_to(g, d, m, f) == ref).all(), (g, d, m, f)


def test_a_search_cut_short_by_the_time_limit_falls_back_or_says_so(monkeypatch):
    """No plan found because the time ran out is not "does not fit": the greedy fallback gives a plan, and
    without one the error names --time-limit."""
    from hethub.partitioner.records import Cluster
    cluster = Cluster.model_validate({
        "name": "big", "nodes": [{"host": f"a{i}", "device_type": "A100-80GB", "count": 8} for i in range(32)],
        "network": {"intra_node_gbps": 2400, "inter_node_gbps": 200}})
    cm = CostModel(cluster, builtin_model("llama-140b"))
    sol, stats = search(cm, 1024, PlannerOptions(time_limit_s=0.3))
    assert sol.cands is not None and 0 < stats["gap"] < 1
    monkeypatch.setattr("hethub.partitioner.search.shapes.greedy_shapes", lambda *a: None)
    with pytest.raises(InfeasibleError, match=r"PlannerOptions.time_limit_s: no plan found within 0.3 s"):
        search(cm, 1024, PlannerOptions(time_limit_s=0.3))


def test_every_shape_milp_has_an_incumbent_to_beat_from_the_first(monkeypatch):
    """The search seeds itself with a greedy chain before any MILP, so even the first MILP has a cutoff: a MILP
    that must find its first plan by itself took 1-4 s on 768 devices, past a 10-s limit on a slower machine,
    and left the fallback's plan (18 samples/s where the MILPs find 29). The plan returned beats the seed or is
    it."""
    from hethub.partitioner.search.shapes import ShapeMilp
    cutoffs = []
    solve = ShapeMilp.solve_counts

    def recorded(self, solver, seconds, cutoff=None):
        cutoffs.append(cutoff)
        return solve(self, solver, seconds, cutoff)

    monkeypatch.setattr(ShapeMilp, "solve_counts", recorded)
    cm = CostModel(TWO_TYPE, builtin_model("gpt-1.3b"))
    sol, stats = search(cm, 64, PlannerOptions(time_limit_s=30))
    assert cutoffs and all(c is not None for c in cutoffs)
    assert sol.objective <= cutoffs[0] * (1 + 1e-9) and stats["gap"] < 0.01
    # MILPs that beat nothing: the seed is the plan, and it is among the alternatives the simulator replays
    monkeypatch.setattr(ShapeMilp, "solve_counts",
                        lambda self, solver, seconds, cutoff=None: ({}, "infeasible", cutoff))
    sol, stats = search(cm, 64, PlannerOptions(time_limit_s=30))
    assert sol.objective == pytest.approx(cutoffs[0]) and sol in stats["alternatives"]


def test_the_bottleneck_bound_holds_where_a_first_stage_paces_faster_than_a_middle_one():
    """Under ``--network no-overlap`` a first stage has no input transfers to charge, so it paces faster than a
    middle stage of as many blocks on the same devices. The bound on the bottleneck (``blocks_lower_bound``)
    counted middle stages only, and on 32 A100 + 96 V100 at 12 Gbit/s (Sailor's case 1) it sat above the
    best plan's bottleneck: every MILP held Z at the bound, priced that plan 1.8% above its value, and the search
    proved a 1.2% worse plan optimal."""
    from hethub.partitioner.records import Cluster, ModelConfig
    from hethub.partitioner.search.candidates import stage_paces_of
    from hethub.partitioner.search.shapes import blocks_lower_bound, shape_candidates
    nodes = ([{"host": f"a{i}", "device_type": "A100-40GB", "count": 4} for i in range(8)]
             + [{"host": f"v{i}", "device_type": "V100-16GB", "count": 4} for i in range(24)])
    cluster = Cluster.model_validate({"nodes": nodes, "network": {
        "intra_node_gbps": {"A100-40GB": 14, "V100-16GB": 10}, "inter_node_gbps": 12}})
    model = ModelConfig(name="opt-350m", architecture="gpt", num_layers=24, hidden_size=1024,
                        num_attention_heads=16, ffn_hidden_size=4096, vocab_size=50272, seq_length=2048)
    cm = CostModel(cluster, model, dtype="fp16")
    opts = PlannerOptions(time_limit_s=60, schedule="zb-h1", network="no-overlap", micro_batch_sizes=(64,))
    sol, stats = search(cm, 1024, opts)
    counts = [cluster.count_by_type()[t] for t in cluster.type_names]
    c = shape_candidates(cm, 64, 16, cluster.type_names, dict(zip(cluster.type_names, counts)), True, 8,
                         schedule="zb-h1", overlap=False)
    t_lb = blocks_lower_bound(c, cm.model.num_planner_layers, counts, 16, [cm.sample_s(t) for t in cluster.type_names])
    assert t_lb <= float(stage_paces_of(sol.cands, sol.chosen).max()) * (1 + 1e-9)
    assert sol.objective < 1.995 and stats["gap"] < 0.01  # the 1.991-s plan, not the 2.014-s one


def test_the_dual_bound_closes_most_of_the_gap_the_simple_bound_leaves():
    """On the example cluster (8 A100 + 4 V100, gpt-1.3b, global batch 8) at micro-batch 2: the simple bound
    ((M - 1) x the smallest feasible bottleneck + every block at its cheapest) sits 38% under the size's proven
    optimum; the dual bound over (bottleneck, all-reduce) regions within 10% of it, and never above it."""
    from hethub.partitioner import load_cluster
    cluster = load_cluster(os.path.join(EXAMPLES, "cluster.yaml"))
    cm = CostModel(cluster, builtin_model("gpt-1.3b"))
    types = cluster.type_names
    counts = [cluster.count_by_type()[t] for t in types]
    shapes = ShapeSearch(cm, 8, PlannerOptions(time_limit_s=30, micro_batch_sizes=(2,)), None, types, counts, [2])
    shapes.run()
    assert shapes.stats()["status"] == "optimal"
    simple, b, M, c, t_lb = shapes.jobs[0][:5]
    best = shapes.best.objective
    dual = DualBound(c, cm.model.num_planner_layers, counts, M, t_lb).bound(best, 1.0)
    assert simple < 0.7 * best
    assert 0.9 * best <= dual <= best * (1 + 1e-9)
