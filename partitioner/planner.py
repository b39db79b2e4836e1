"""The planner: non-uniform stages, per-stage device type and width, sample splits, micro-batch size,
recompute — as a MILP over candidate stages (PuLP; HiGHS by default, CBC as fallback).

Planning objective (1F1B, one iteration), for stages s with per-micro-batch cost c_s (forward +
backward of its share of the micro-batch, plus the transfer of its output boundary):

    T = (M - 1) * max_s c_s + sum_s c_s + max_s allreduce_s + max_s optimizer_s

Formulation (for each micro-batch size b, M = G / b, solved separately — decomposition):
- one binary x_c per candidate stage c = (unit range [i, j), device type t, width w, recompute r);
  a stage's w replicas split the micro-batch evenly (ceil(b / w) samples at most, w <= b);
- flow over unit boundaries: exactly one chain of candidates from 0 to U;
- bottleneck rows per unit, written sparsely with a running load (measured before the planner was written: one row per
  *layer* gives an LP bound of 3.99 vs 0.53 with one row per candidate);
- device rows: sum of widths of type t <= devices of type t;
- 1F1B memory, exactly: a stage starting at unit i keeps min(S_i, M) micro-batches in flight,
  where S_i = number of stages from i to the end (a linear recursion r_i = r_{i+1} + sum x_c).
  A candidate that fits k < M in-flight micro-batches gets r_i + (U - k) x_c <= U, aggregated over
  the candidates starting at i (at most one of them is chosen).

Candidate pruning: only the smallest width for each distinct ceil(b / w) (more devices for the same
samples per replica never helps); recompute only where it lets the stage hold more micro-batches.
Models with more than ``max_units`` planner layers have their blocks grouped into equal chunks
(every block of a model has the same cost, so this only restricts where stages may cut).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from .costmodel import BYTES_PER_ACT, OPTIMIZER_PASSES, PCIE_GBPS, CostModel
from .errors import InfeasibleError, InputError
from .placement import StageLayout, even_split
from .records import MAX_MICRO_BATCHES, ModelConfig


@dataclass(frozen=True)
class PlannerOptions:
    solver: str = "highs"  # highs | cbc | brute-force
    time_limit_s: float = 60.0  # for the whole search, split over micro-batch sizes
    micro_batch_sizes: Optional[tuple[int, ...]] = None  # default: divisors of the global batch <= max
    max_micro_batch_size: int = 64
    allow_recompute: bool = True
    max_units: int = 48
    device_types: Optional[tuple[str, ...]] = None  # restrict to these types (fastest-only, homogeneous sums)
    # Every stage the same width w, each replica micro_batch / w samples: what Megatron-core's
    # parallel_state can express (stages may still differ in device type and layer count).
    equal_widths: bool = False


@dataclass
class Candidates:
    """Candidate stages for one micro-batch size, as parallel numpy arrays."""

    i: np.ndarray  # first unit
    j: np.ndarray  # end unit (exclusive)
    t: np.ndarray  # index into types
    w: np.ndarray  # width
    rc: np.ndarray  # recompute (bool)
    c: np.ndarray  # per-micro-batch cost, s
    ar: np.ndarray  # gradient all-reduce, s
    opt: np.ndarray  # optimizer step, s
    k: np.ndarray  # micro-batches in flight that fit in memory (capped at M)
    v: np.ndarray  # vendor id of the device type
    pen: np.ndarray  # extra per-micro-batch seconds when the next stage is another vendor's (host bridge)

    def __len__(self) -> int:
        return len(self.c)


FIELDS = ("i", "j", "t", "w", "rc", "c", "ar", "opt", "k", "v", "pen")


@dataclass
class Solution:
    b: int
    M: int
    chosen: list[int]  # candidate indices, in pipeline order
    objective: float
    bound: float
    status: str
    cands: Candidates = field(repr=False)


def units_for(model: ModelConfig, max_units: int) -> list[tuple[int, int]]:
    """Planner layer ranges the solver may cut between: every layer, or equal chunks of blocks."""
    n = model.num_planner_layers
    if n <= max_units:
        return [(l, l + 1) for l in range(n)]
    blocks = model.num_layers
    chunks = max_units - 2
    size = math.ceil(blocks / chunks)
    units = [(0, 1)]
    for start in range(1, blocks + 1, size):
        units.append((start, min(start + size, blocks + 1)))
    units.append((n - 1, n))
    return units


def widths_for(b: int, available: int) -> list[int]:
    """Smallest width for each distinct ceil(b / w), w <= min(b, available)."""
    out, seen = [], set()
    for w in range(1, min(b, available) + 1):
        s = -(-b // w)
        if s not in seen:
            seen.add(s)
            out.append(w)
    return out


def _range_max(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Table m[i, j] = max(values[bounds[i]:bounds[j]]) for unit boundaries i < j."""
    n = len(bounds)
    m = np.zeros((n, n))
    for i in range(n - 1):
        cur = -np.inf
        for j in range(i + 1, n):
            cur = max(cur, values[bounds[j - 1]:bounds[j]].max())
            m[i, j] = cur
    return m


def candidates(cm: CostModel, units: list[tuple[int, int]], b: int, M: int, types: Sequence[str],
               counts: dict[str, int], allow_recompute: bool = True, width: Optional[int] = None) -> Candidates:
    """Every feasible candidate stage for micro-batch size b (vectorised over unit ranges).

    ``width``: only stages of exactly this width (plans Megatron-core can express: equal widths).
    """
    bounds = np.array([u[0] for u in units] + [units[-1][1]])
    I, J = np.triu_indices(len(bounds), k=1)
    a, e = bounds[I], bounds[J]
    lay = cm.layers
    cum = lambda v: np.concatenate([[0.0], np.cumsum(v)])  # noqa: E731
    params = (cum(lay.params)[e] - cum(lay.params)[a])
    act = {False: cum(lay.act_bytes)[e] - cum(lay.act_bytes)[a],
           True: cum(lay.act_bytes_recompute)[e] - cum(lay.act_bytes_recompute)[a]}
    act_max = _range_max(lay.act_bytes, bounds)[I, J]
    out_bytes = lay.out_bytes[e - 1]  # 0 for the last layer
    in_bytes = lay.out_bytes[np.maximum(a - 1, 0)]
    node_max = {t: max(n.count for n in cm.cluster.nodes if n.device_type == t) for t in types}
    cols: dict[str, list] = {k: [] for k in FIELDS}
    vendor_ids = {v: n for n, v in enumerate(sorted({cm.cluster.device_type(t).vendor for t in types}))}
    net = cm.cluster.network
    gx, lx = (net.cross_vendor_gbps or net.inter_node_gbps), net.inter_node_latency_us * 1e-6
    for ti, t in enumerate(types):
        dt = cm.cluster.device_type(t)
        limit = cm.memory_limit_bytes(t)
        for rc in ((False, True) if allow_recompute else (False,)):
            per_sample = cm.prefix(t, rc)[e] - cm.prefix(t, rc)[a]
            fixed = cm.prefix_fixed(t, rc)[e] - cm.prefix_fixed(t, rc)[a]
            for w in (widths_for(b, counts[t]) if width is None else ([width] if width <= counts[t] else [])):
                s = -(-b // w)
                # Output boundary: this stage's share crosses to the next stage and the gradient comes back.
                # Intra-node when the type's largest node holds this stage and an equal-width neighbour.
                intra = 2 * w <= node_max[t]
                gbps, lat = cm._link_gbps(t, t, same_host=intra)
                # Inter-node: the replicas sharing a node also share its NIC (as the evaluator and simulator
                # model it), so a node's share of the micro-batch queues on one link.
                per_link = s if intra else min(w, node_max[t]) * s
                comm = np.where(out_bytes > 0, 2 * (lat + per_link * out_bytes * 8 / (gbps * 1e9)), 0.0)
                c = fixed + per_sample * s + comm
                # ... and when the next stage is another vendor's: host copies both ways, the cross-vendor link
                per_x = min(w, node_max[t]) * s
                cross = np.where(out_bytes > 0, 2 * (lx + per_x * out_bytes * 8 / (gx * 1e9)
                                                     + 2 * s * out_bytes / (PCIE_GBPS * 1e9)), 0.0)
                pen = np.maximum(cross - comm, 0.0)
                one_node = w <= node_max[t]
                ag, alat = cm._link_gbps(t, t, same_host=one_node)
                ar = (2 * (w - 1) * alat + 2 * (w - 1) / w * params * BYTES_PER_ACT * 8 / (ag * 1e9)) if w > 1 \
                    else np.zeros_like(params)
                state = params * (4.0 + 12.0 / w) if cm.zero1 else params * 16.0
                opt = state * OPTIMIZER_PASSES / (dt.memory_gbps * 1e9)
                cap = limit - state - 2.0 * in_bytes * s - (act_max * s if rc else 0.0)
                per_flight = np.maximum(act[rc] * s, 1.0)
                k = np.floor(np.where(cap > 0, cap / per_flight, 0.0))
                k = np.minimum(k, M)
                keep = k >= 1
                n = int(keep.sum())
                cols["i"].append(I[keep]); cols["j"].append(J[keep]); cols["t"].append(np.full(n, ti))
                cols["w"].append(np.full(n, w)); cols["rc"].append(np.full(n, rc)); cols["c"].append(c[keep])
                cols["ar"].append(ar[keep]); cols["opt"].append(opt[keep]); cols["k"].append(k[keep])
                cols["v"].append(np.full(n, vendor_ids[dt.vendor])); cols["pen"].append(pen[keep])
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}
    cand = Candidates(**{k: cat[k] for k in cols})
    cand.i, cand.j, cand.t, cand.w = (cand.i.astype(int), cand.j.astype(int), cand.t.astype(int),
                                      cand.w.astype(int))
    cand.rc = cand.rc.astype(bool)
    cand.v = cand.v.astype(int)
    return _prune_recompute(cand)


def _prune_recompute(c: Candidates) -> Candidates:
    """Drop a recompute candidate when the same stage without recompute holds as many micro-batches."""
    if not c.rc.any():
        return c
    key = c.i * 1_000_003 + c.j * 1009 + c.t * 131 + c.w
    best_plain = {}
    for idx in np.flatnonzero(~c.rc):
        best_plain[key[idx]] = c.k[idx]
    keep = np.ones(len(c), dtype=bool)
    for idx in np.flatnonzero(c.rc):
        if best_plain.get(key[idx], -1) >= c.k[idx]:
            keep[idx] = False
    return Candidates(*(getattr(c, f)[keep] for f in FIELDS))


def stage_costs_of(c: Candidates, chosen: Sequence[int]) -> np.ndarray:
    """Per-micro-batch cost of each stage of a chain, with the bridge penalty where the next stage's vendor differs."""
    ch = list(chosen)
    cost = c.c[ch].astype(float)
    for n in range(len(ch) - 1):
        if c.v[ch[n]] != c.v[ch[n + 1]]:
            cost[n] += c.pen[ch[n]]
    return cost


def objective_of(c: Candidates, chosen: Sequence[int], M: int) -> float:
    """The planning objective of a chain of candidates (same formula the MILP minimises)."""
    ch = list(chosen)
    cost = stage_costs_of(c, ch)
    return float((M - 1) * cost.max() + cost.sum() + c.ar[ch].max() + c.opt[ch].max())


def chain_is_feasible(c: Candidates, chosen: Sequence[int], counts: Sequence[int], M: int) -> bool:
    used = np.zeros(len(counts), dtype=int)
    S = len(chosen)
    for pos, idx in enumerate(chosen):
        used[c.t[idx]] += c.w[idx]
        if c.k[idx] < min(S - pos, M):
            return False
    return bool((used <= np.asarray(counts)).all())


# ------------------------------------------------------------------------- bounds


def chain_dp(c: Candidates, U: int, M: int, cost: np.ndarray, ok: Optional[np.ndarray] = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest memory-feasible chains by (start boundary u, stages from u to the end r).

    dp[u, r] = min over candidates k starting at u (allowed by ``ok``, holding min(r, M) micro-batches)
    of cost[k] + dp[j_k, r - 1]; arg[u, r] is that k. The 1F1B memory rule is exact here, device
    limits are not (callers relax or check them).
    """
    R = U
    dp = np.full((U + 1, R + 1), np.inf)
    dp[U, 0] = 0.0
    arg = np.full((U + 1, R + 1), -1)
    need = np.minimum(np.arange(1, R + 1), M)  # in-flight micro-batches for r = 1..R
    order = np.argsort(c.i, kind="stable")
    i_sorted = c.i[order]
    for u in range(U - 1, -1, -1):
        lo, hi = np.searchsorted(i_sorted, u), np.searchsorted(i_sorted, u, side="right")
        ks = order[lo:hi]
        if ok is not None:
            ks = ks[ok[ks]]
        if not len(ks):
            continue
        vals = cost[ks, None] + dp[c.j[ks], :R]  # a chain of r stages from u: this one + r-1 from j
        vals = np.where(c.k[ks, None] >= need[None, :], vals, np.inf)
        best = vals.argmin(axis=0)
        dp[u, 1:] = vals[best, np.arange(R)]
        arg[u, 1:] = ks[best]
    return dp, arg


def min_devices_chain(c: Candidates, U: int, T: float, M: int) -> float:
    """Fewest devices (all types together) of a chain whose stages all cost <= T and fit 1F1B memory."""
    dp, _ = chain_dp(c, U, M, c.w.astype(float), c.c <= T)
    return float(dp[0].min())


def sum_lower_bound(c: Candidates, U: int, total_devices: int, M: int) -> float:
    """A lower bound on the sum of stage costs of any feasible chain (Lagrangian relaxation of the device total).

    For any lambda >= 0: min over memory-feasible chains of sum(c + lambda w) - lambda N <= the true
    minimum of sum(c) subject to sum(w) <= N. The best of a few lambdas is taken.
    """
    scale = float(np.median(c.c / c.w))
    best = 0.0
    for lam in (0.0, 0.1 * scale, 0.3 * scale, scale, 3 * scale):
        dp, _ = chain_dp(c, U, M, c.c + lam * c.w)
        best = max(best, float(dp[0].min()) - lam * total_devices)
    return best


def bottleneck_lower_bound(c: Candidates, U: int, total_devices: int, M: int) -> float:
    """Smallest stage cost T for which some chain fits the device total (a relaxation: a valid bound on Z)."""
    values = np.unique(c.c)
    lo, hi = 0, len(values) - 1
    if min_devices_chain(c, U, values[hi], M) > total_devices:
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if min_devices_chain(c, U, values[mid], M) <= total_devices:
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


def heuristic_chain(c: Candidates, U: int, counts: Sequence[int], M: int, T: float, weights: np.ndarray
                    ) -> Optional[list[int]]:
    """A memory-feasible chain with stages costing <= T that uses the fewest (weighted) devices; None when
    the chain found breaks a per-type device limit. Gives the MILP an incumbent to prune against."""
    dp, arg = chain_dp(c, U, M, weights[c.t] * c.w, c.c <= T)
    r = int(dp[0].argmin())
    if not np.isfinite(dp[0, r]):
        return None
    chain, u = [], 0
    while u < U:
        k = int(arg[u, r])
        chain.append(k)
        u, r = int(c.j[k]), r - 1
    return chain if chain_is_feasible(c, chain, counts, M) else None


def incumbent(c: Candidates, U: int, counts: Sequence[int], M: int, t_lb: float) -> Optional[list[int]]:
    """Best of a few heuristic chains at bottleneck thresholds a little above the lower bound."""
    counts_a = np.asarray(counts, dtype=float)
    best, best_obj = None, math.inf
    values = np.unique(c.c)
    for factor in (1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0, 3.0):
        T = values[min(np.searchsorted(values, t_lb * factor, side="right"), len(values)) - 1]
        for weights in (1.0 / counts_a, np.ones_like(counts_a)):
            chain = heuristic_chain(c, U, counts, M, T, weights)
            if chain is not None:
                obj = objective_of(c, chain, M)
                if obj < best_obj:
                    best, best_obj = chain, obj
        if best is not None and factor >= 1.2:
            break
    return best


def restrict(c: Candidates, keep: np.ndarray) -> tuple[Candidates, np.ndarray]:
    idx = np.flatnonzero(keep)
    return Candidates(*(getattr(c, f)[idx] for f in FIELDS)), idx


# ------------------------------------------------------------------------- MILP


def solve_milp(c: Candidates, U: int, counts: Sequence[int], M: int, solver: str, time_limit_s: float,
               z_lower: float = 0.0, cutoff: Optional[float] = None) -> tuple[Optional[list[int]], float, float, str]:
    """(chosen candidates in order or None, objective, lower bound, status: optimal|feasible|infeasible|timeout).

    ``cutoff``: only solutions below it are of interest (an incumbent from another micro-batch size).

    ``z_lower`` is a valid lower bound on the bottleneck (``bottleneck_lower_bound``): with it the LP
    relaxation no longer spreads a fraction of every stage thin to make the bottleneck look cheap.
    """
    import pulp

    n = len(c)
    if n == 0:
        return None, math.inf, math.inf, "infeasible"
    prob = pulp.LpProblem("hethub_plan", pulp.LpMinimize)
    # PuLP >= 3.3 owns variables by the model (add_variable); older releases construct them directly.
    var = getattr(prob, "add_variable", None) or (lambda name, lowBound=None, upBound=None, cat="Continuous":
                                                   pulp.LpVariable(name, lowBound, upBound, cat))
    x = [var(f"x{k}", cat=pulp.LpBinary) for k in range(n)]
    Z = var("Z", lowBound=z_lower)  # bottleneck per-micro-batch cost
    A = var("A", lowBound=0)  # slowest all-reduce
    O = var("O", lowBound=0)  # slowest optimizer step
    prob += (M - 1) * Z + pulp.LpAffineExpression([(x[k], float(c.c[k])) for k in range(n)]) + A + O

    starts: list[list[int]] = [[] for _ in range(U + 1)]
    ends: list[list[int]] = [[] for _ in range(U + 1)]
    for k in range(n):
        starts[c.i[k]].append(k)
        ends[c.j[k]].append(k)
    # flow: one chain from boundary 0 to boundary U
    prob += pulp.lpSum(x[k] for k in starts[0]) == 1
    prob += pulp.lpSum(x[k] for k in ends[U]) == 1
    for p in range(1, U):
        prob += pulp.lpSum(x[k] for k in ends[p]) == pulp.lpSum(x[k] for k in starts[p])
    # running loads: y[u] = value of the stage covering unit u (for c, ar, opt); bottleneck rows per unit
    loads: dict[str, list] = {}
    for top, vals, name in ((Z, c.c, "c"), (A, c.ar, "ar"), (O, c.opt, "opt")):
        prev = None
        loads[name] = []
        for u in range(U):
            y = var(f"y_{name}_{u}", lowBound=0)
            loads[name].append(y)
            expr = pulp.LpAffineExpression([(x[k], float(vals[k])) for k in starts[u]] +
                                           [(x[k], -float(vals[k])) for k in ends[u]])
            prob += (y == (prev if prev is not None else 0) + expr)
            prob += top >= y
            prev = y
    # A boundary between vendors: z[p] = 1 when the stage ending at p and the one starting there differ in
    # vendor; q[p] >= the ending stage's bridge penalty then, added to its cost (sum and bottleneck).
    if len(set(c.v.tolist())) > 1:
        for p in range(1, U):
            if not ends[p] or not starts[p]:
                continue
            z = var(f"z_{p}", lowBound=0, upBound=1)
            for vid in set(c.v.tolist()):
                e_v = [(x[k], 1.0) for k in ends[p] if c.v[k] == vid]
                s_v = [(x[k], -1.0) for k in starts[p] if c.v[k] == vid]
                if e_v:
                    prob += z >= pulp.LpAffineExpression(e_v + s_v)
            pmax = float(max(c.pen[k] for k in ends[p]))
            if pmax <= 0:
                continue
            q = var(f"q_{p}", lowBound=0)
            prob += q >= pulp.LpAffineExpression([(x[k], float(c.pen[k])) for k in ends[p]]) - pmax * (1 - z)
            prob += Z >= loads["c"][p - 1] + q
            prob.objective += q
    # stages remaining from boundary u: r[u] = r[u+1] + (stages starting at u); memory rows
    r_next = None
    for u in range(U - 1, -1, -1):
        r = var(f"r_{u}", lowBound=0)
        prob += r == (r_next if r_next is not None else 0) + pulp.lpSum(x[k] for k in starts[u])
        tight = [k for k in starts[u] if c.k[k] < M]
        if tight:
            prob += r + pulp.LpAffineExpression([(x[k], float(U - c.k[k])) for k in tight]) <= U
        r_next = r
    for ti, cnt in enumerate(counts):
        ks = np.flatnonzero(c.t == ti)
        if len(ks):
            prob += pulp.LpAffineExpression([(x[k], float(c.w[k])) for k in ks]) <= cnt

    if solver == "highs":
        extra = {"objective_bound": float(cutoff)} if cutoff is not None else {}
        s = pulp.HiGHS(msg=False, timeLimit=max(0.2, time_limit_s), presolve="off", threads=1, **extra)
    elif solver == "cbc":
        import warnings
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC in favour of pulp[cbc]'s COIN_CMD
            warnings.simplefilter("ignore", DeprecationWarning)
            s = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))), threads=1)
    else:
        raise InputError("--solver", f"unknown MILP solver {solver!r}")
    with _quiet_stdout():
        prob.solve(s)
    bound = 0.0
    if solver == "highs":
        info = prob.solverModel.getInfo()
        bound = float(info.mip_dual_bound) if math.isfinite(info.mip_dual_bound) else 0.0
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
            return None, math.inf, math.inf, "infeasible"
        if cutoff is not None and solver == "highs" and prob.solverModel.getModelStatus() == \
                __import__("highspy").HighsModelStatus.kObjectiveBound:
            return None, math.inf, float(cutoff), "infeasible"  # nothing better than the cutoff exists
        return None, math.inf, bound, "timeout"
    chosen = [k for k in range(n) if (x[k].value() or 0) > 0.5]
    chosen.sort(key=lambda k: c.i[k])
    obj = objective_of(c, chosen, M)
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible"
    # CBC through PuLP reports no bound (and "Optimal" on a time-out: sol_status tells them apart)
    return chosen, obj, (obj if status == "optimal" else min(bound, obj)), status


class _quiet_stdout:
    """HiGHS prints its banner from C++ on file descriptor 1, past msg=False: silence the fd while solving."""

    def __enter__(self):
        import os
        import sys
        sys.stdout.flush()
        self.saved = os.dup(1)
        self.null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(self.null, 1)

    def __exit__(self, *exc):
        import os
        os.dup2(self.saved, 1)
        os.close(self.saved)
        os.close(self.null)


# ------------------------------------------------------------------------- brute force


def solve_brute_force(c: Candidates, U: int, counts: Sequence[int], M: int, max_nodes: int = 20_000_000,
                      deadline: float = math.inf, time_limit_s: float = math.inf
                      ) -> Optional[tuple[list[int], float]]:
    """Enumerate every chain of candidates (small instances only): the reference for the MILP.

    Depth-first over chains, pruning only what cannot matter: a partial chain that already uses more
    devices of a type than exist, or whose partial objective (every term only grows as stages are
    added) already reaches the best complete chain's.
    """
    starts: list[list[int]] = [[] for _ in range(U + 1)]
    for k in np.argsort(c.c, kind="stable"):
        starts[c.i[k]].append(int(k))
    cc, ar, opt, w, t = c.c.tolist(), c.ar.tolist(), c.opt.tolist(), c.w.tolist(), c.t.tolist()
    vend, pen = c.v.tolist(), c.pen.tolist()
    used = [0] * len(counts)
    best: list = [None, math.inf]
    nodes = [0]

    def walk(u: int, chain: list[int], mx: float, sm: float, mar: float, mop: float):
        # mx/sm count every stage's cost; the last stage's bridge penalty is added once its successor is known
        nodes[0] += 1
        if nodes[0] > max_nodes:
            raise InputError("--solver", f"brute force is for small instances: more than {max_nodes} partial "
                                         f"chains; use --solver highs")
        if nodes[0] % 4096 == 0 and time.perf_counter() > deadline:
            raise InputError("--time-limit", f"brute force did not finish within {time_limit_s:g} s; it is for "
                                             f"small instances: use --solver highs")
        if (M - 1) * mx + sm + mar + mop >= best[1]:
            return
        if u == U:
            if chain_is_feasible(c, chain, counts, M):
                best[0], best[1] = list(chain), (M - 1) * mx + sm + mar + mop
            return
        for k in starts[u]:
            if used[t[k]] + w[k] > counts[t[k]]:
                continue
            used[t[k]] += w[k]
            extra = pen[chain[-1]] if chain and vend[chain[-1]] != vend[k] else 0.0
            prev_cost = cc[chain[-1]] + extra if chain else 0.0
            chain.append(k)
            walk(int(c.j[k]), chain, max(mx, cc[k], prev_cost), sm + cc[k] + extra, max(mar, ar[k]),
                 max(mop, opt[k]))
            chain.pop()
            used[t[k]] -= w[k]

    walk(0, [], 0.0, 0.0, 0.0, 0.0)
    return None if best[0] is None else (best[0], objective_of(c, best[0], M))


# ------------------------------------------------------------------------- driver


def micro_batch_sizes(global_batch: int, opts: PlannerOptions) -> list[int]:
    if opts.micro_batch_sizes:
        bad = [b for b in opts.micro_batch_sizes if b < 1 or global_batch % b]
        if bad:
            raise InfeasibleError("micro_batch_sizes", f"{bad[0]} does not divide the global batch {global_batch}")
        sizes = sorted(opts.micro_batch_sizes)
    else:
        sizes = [b for b in range(1, min(global_batch, opts.max_micro_batch_size) + 1) if global_batch % b == 0]
    out = [b for b in sizes if global_batch // b <= MAX_MICRO_BATCHES]
    if sizes and not out:
        raise InfeasibleError("--global-batch", f"{global_batch} needs more than {MAX_MICRO_BATCHES} micro-batches at "
                                                f"micro-batch sizes up to {max(sizes)}; allow larger ones "
                                                f"(--max-micro-batch / --micro-batch-sizes)")
    return out


def search(cm: CostModel, global_batch: int, opts: PlannerOptions = PlannerOptions(),
           progress: Optional[Callable[[dict], None]] = None) -> tuple[Solution, dict]:
    """Best solution over micro-batch sizes; also returns search statistics.

    ``progress``, if given, is called after every MILP with the search's state (micro-batch size just
    solved, sizes done/total, incumbent and lower bound in seconds, elapsed seconds): a live status.

    Micro-batch sizes are visited in order of their lower bound M * T_lb (T_lb: the smallest
    bottleneck any chain fitting the device total can have); a size whose bound cannot beat the
    incumbent is skipped, and candidates costing more than incumbent / M are dropped before the MILP
    (no stage of a better plan can cost more). Both cuts are exact.
    """
    if global_batch < 1:
        raise InputError("--global-batch", f"must be >= 1, got {global_batch}")
    counts_all = cm.cluster.count_by_type()
    types = list(opts.device_types or cm.cluster.type_names)
    for t in types:
        if t not in counts_all:
            raise InputError("device_types", f"cluster {cm.cluster.name!r} has no {t!r} devices")
    counts = [counts_all[t] for t in types]
    units = units_for(cm.model, opts.max_units)
    U = len(units)
    bs = micro_batch_sizes(global_batch, opts)
    t0 = time.perf_counter()
    todo = []
    n_cands = 0
    # With equal widths, each (micro-batch size, width) pair is its own sub-problem.
    jobs = [(b, w) for b in bs for w in range(1, min(b, max(counts)) + 1) if b % w == 0] if opts.equal_widths \
        else [(b, None) for b in bs]
    for b, w in jobs:
        M = global_batch // b
        cand = candidates(cm, units, b, M, types, dict(zip(types, counts)), opts.allow_recompute, width=w)
        n_cands += len(cand)
        t_lb = bottleneck_lower_bound(cand, U, sum(counts), M) if len(cand) else math.inf
        lb = (M - 1) * t_lb + sum_lower_bound(cand, U, sum(counts), M) if math.isfinite(t_lb) else math.inf
        todo.append((lb, (b, w), M, cand, t_lb))
    todo.sort(key=lambda x: x[0])
    brute = opts.solver == "brute-force"  # the reference: no bounding, every chain of every size
    best: Optional[Solution] = None
    bounds: dict[int, float] = {b: lb for lb, b, _, _, _ in todo}
    solved: dict[int, bool] = {}
    milp_vars = 0

    pool: dict[tuple, Solution] = {}  # the best chain found per (micro-batch size, width) job

    def offer(sol: Solution, job: tuple) -> None:
        nonlocal best
        if job not in pool or sol.objective < pool[job].objective:
            pool[job] = sol
        if best is None or sol.objective < best.objective:
            best = sol

    def attempt(entry, seconds: float) -> None:
        nonlocal best, milp_vars
        lb, b, M, cand, t_lb = entry
        if not brute and (not math.isfinite(lb) or (best is not None and lb >= best.objective * (1 - 1e-9))):
            solved[b] = True
            return
        cut = best.objective if best is not None and not brute else None
        sub, back = (restrict(cand, cand.c <= cut / M * (1 + 1e-9)) if cut is not None
                     else (cand, np.arange(len(cand))))
        if brute:
            res = solve_brute_force(sub, U, counts, M, deadline=t0 + opts.time_limit_s, time_limit_s=opts.time_limit_s)
            chosen, obj, bound, status = (None, math.inf, math.inf, "infeasible") if res is None else \
                (res[0], res[1], res[1], "optimal")
        else:
            milp_vars += len(sub)
            chosen, obj, bound, status = solve_milp(sub, U, counts, M, opts.solver, seconds, z_lower=t_lb,
                                                    cutoff=cut)
        bounds[b] = max(bounds[b], bound if status != "infeasible" else (cut if cut is not None else math.inf))
        solved[b] = status in ("optimal", "infeasible")
        if progress is not None:
            progress({"micro_batch_size": b[0], "done": sum(solved.values()), "total": len(todo),
                      "incumbent_s": best.objective if best is not None else math.inf,
                      "bound_s": min(bounds.values()), "elapsed_s": time.perf_counter() - t0})
        if chosen is not None:
            offer(Solution(b[0], M, [int(back[k]) for k in chosen], obj, bound, status, cand), b)

    # Incumbents from the heuristic chain for every size: the MILPs then only look below the best.
    if not brute:
        for lb, b, M, cand, t_lb in todo:
            if math.isfinite(t_lb):
                chain = incumbent(cand, U, counts, M, t_lb)
                if chain is not None:
                    offer(Solution(b[0], M, chain, objective_of(cand, chain, M), lb, "feasible", cand), b)
    # Pass 1: every size briefly, most promising first (an early incumbent prunes the rest);
    # pass 2: the sizes left unproven, with the remaining time.
    quick = opts.time_limit_s / (2 * max(1, len(todo)))
    for entry in todo:
        attempt(entry, min(quick, 2.0))
    for k, entry in enumerate(todo):
        if solved.get(entry[1]) or (best is not None and bounds[entry[1]] >= best.objective * (1 - 1e-9)):
            continue
        left = opts.time_limit_s - (time.perf_counter() - t0)
        if left <= 0.2:
            break
        attempt(entry, left / max(1, sum(1 for e in todo[k:] if not solved.get(e[1]))))
    if best is None:
        raise _infeasible(cm, global_batch, types, counts, bs)
    lower = min(bounds.values())
    gap = max(0.0, (best.objective - lower) / best.objective)
    stats = {"seconds": time.perf_counter() - t0, "micro_batch_sizes": bs, "candidates": n_cands, "units": U,
             "milp_variables": milp_vars, "gap": gap, "status": "optimal" if gap <= 1e-6 else "feasible",
             "alternatives": sorted(pool.values(), key=lambda s: s.objective)}
    return best, stats


def _infeasible(cm: CostModel, global_batch: int, types: list[str], counts: list[int], bs: list[int]):
    """One line saying which constraint fails and by how much."""
    if not bs:
        return InfeasibleError("--global-batch", f"no micro-batch size divides {global_batch}")
    # memory: the whole model's state spread over every device, one layer each at best
    total_state = cm.state_bytes(0, cm.model.num_planner_layers)
    total_mem = sum(cm.memory_limit_bytes(t) * n for t, n in zip(types, counts))
    if total_state > total_mem:
        return InfeasibleError("memory", f"model {cm.model.name!r} needs {total_state / 2**30:.1f} GiB for weights, "
                                         f"gradients and optimizer state; the devices hold "
                                         f"{total_mem / 2**30:.1f} GiB after the reserve "
                                         f"(short by {(total_state - total_mem) / 2**30:.1f} GiB)")
    biggest = max(float(cm.state_bytes(l, l + 1) + cm.layers.act_bytes_recompute[l] + cm.layers.act_bytes[l])
                  for l in range(cm.model.num_planner_layers))
    largest_dev = max(cm.memory_limit_bytes(t) for t in types)
    if biggest > largest_dev:
        return InfeasibleError("memory", f"the largest layer needs {biggest / 2**30:.1f} GiB for one sample, the "
                                         f"largest device holds {largest_dev / 2**30:.1f} GiB after the reserve "
                                         f"(short by {(biggest - largest_dev) / 2**30:.1f} GiB); "
                                         f"tensor parallelism is not planned yet")
    return InfeasibleError("memory", f"no stage layout of {cm.model.name!r} fits the devices' memory at any "
                                     f"micro-batch size in {bs} (1F1B keeps up to one micro-batch per later stage "
                                     f"in flight); add devices or use a smaller global batch")


def solution_layouts(sol: Solution, units: list[tuple[int, int]], types: list[str]) -> list[StageLayout]:
    c = sol.cands
    out = []
    for k in sol.chosen:
        out.append(StageLayout(layers=(units[c.i[k]][0], units[c.j[k] - 1][1]), device_type=types[c.t[k]],
                               samples=even_split(sol.b, int(c.w[k])), recompute=bool(c.rc[k])))
    return out
