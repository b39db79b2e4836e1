"""The chain search: non-uniform stages, per-stage device type and width, sample splits, micro-batch size,
recompute — as a MILP over candidate stages (PuLP; HiGHS by default, CBC as fallback).

Planning objective (1F1B, one iteration), for stages s with per-micro-batch cost c_s (forward +
backward of its share of the micro-batch, plus the transfer of its output boundary) and pace
p_s = max(compute, transfer) (the runtime posts transfers non-blocking, so they overlap the compute):

    T = (M - 1) * max_s p_s + sum_s c_s + max_s allreduce_s + max_s optimizer_s

Under schedule zb-h1 (``--schedule zb-h1``) every stage after the first sends its input gradient before computing
its weights' (w_s): c_s is charged without w_s, and allreduce_s waits for the W's after its last B (w_s; the
last stage 2 w_s): the plan-time form of ``evaluate.iteration_s``, which the replay then checks.

Formulation (for each micro-batch size b, M = G / b, solved separately — decomposition):
- one binary x_c per candidate stage c = (unit range [i, j), device type t, width w, recompute r);
  a stage's w replicas split the micro-batch evenly (ceil(b / w) samples at most, w <= b);
- flow over unit boundaries: exactly one chain of candidates from 0 to U;
- bottleneck (pace) rows per unit, written sparsely with a running load (measured before the planner was written:
  one row per *layer* gives an LP bound of 3.99 vs 0.53 with one row per candidate);
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

import itertools
import math
import time
from typing import Optional, Sequence

import numpy as np
import pulp

from ..errors import InputError
from .candidates import Candidates, chain_is_feasible, objective_of, one_run_per_type
from .milp import MilpModel


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
    order = np.argsort(c.first_unit, kind="stable")
    i_sorted = c.first_unit[order]
    for u in range(U - 1, -1, -1):
        lo, hi = np.searchsorted(i_sorted, u), np.searchsorted(i_sorted, u, side="right")
        ks = order[lo:hi]
        if ok is not None:
            ks = ks[ok[ks]]
        if not len(ks):
            continue
        vals = cost[ks, None] + dp[c.end_unit[ks], :R]  # a chain of r stages from u: this one + r-1 from j
        vals = np.where(c.in_flight[ks, None] >= need[None, :], vals, np.inf)
        best = vals.argmin(axis=0)
        dp[u, 1:] = vals[best, np.arange(R)]
        arg[u, 1:] = ks[best]
    return dp, arg


def min_devices_chain(c: Candidates, U: int, T: float, M: int) -> float:
    """Fewest devices (all types together) of a chain whose stages all cost <= T and fit 1F1B memory."""
    dp, _ = chain_dp(c, U, M, c.devices.astype(float), c.pace_s <= T)
    return float(dp[0].min())


def sum_lower_bound(c: Candidates, U: int, total_devices: int, M: int) -> float:
    """A lower bound on the sum of stage costs of any feasible chain (Lagrangian relaxation of the device total).

    For any lambda >= 0: min over memory-feasible chains of sum(c + lambda w) - lambda N <= the true
    minimum of sum(c) subject to sum(w) <= N. The best of a few lambdas is taken.
    """
    scale = float(np.median(c.cost_s / c.devices))
    best = 0.0
    for lam in (0.0, 0.1 * scale, 0.3 * scale, scale, 3 * scale):
        dp, _ = chain_dp(c, U, M, c.cost_s + lam * c.devices)
        best = max(best, float(dp[0].min()) - lam * total_devices)
    return best


def bottleneck_lower_bound(c: Candidates, U: int, total_devices: int, M: int) -> float:
    """Smallest stage pace T for which some chain fits the device total (a relaxation: a valid bound on Z)."""
    values = np.unique(c.pace_s)
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


def ordered_chain_dp(c: Candidates, U: int, M: int, cost: np.ndarray, ok: np.ndarray, order: Sequence[int]
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``chain_dp`` over pure stages whose device types follow ``order``, each type in one run (``--equal-widths``:
    ``one_run_per_type``). dp[j][u, r]: the cheapest chain of r stages from u using types order[j:] in order;
    arg[j][u, r]: its first candidate, or -1 where it starts with a later type (dp[j + 1])."""
    R = U
    need = np.minimum(np.arange(1, R + 1), M)
    dps: list[np.ndarray] = [np.empty(0)] * len(order)
    args: list[np.ndarray] = [np.empty(0)] * len(order)
    for j in range(len(order) - 1, -1, -1):
        later = dps[j + 1] if j + 1 < len(order) else None
        dp = np.full((U + 1, R + 1), np.inf) if later is None else later.copy()
        dp[U, 0] = 0.0
        arg = np.full((U + 1, R + 1), -1)
        mine = ok & (c.type_idx == order[j]) & (c.type2_idx < 0)
        for u in range(U - 1, -1, -1):
            ks = np.flatnonzero(mine & (c.first_unit == u))
            if not len(ks):
                continue
            vals = cost[ks, None] + dp[c.end_unit[ks], :R]
            vals = np.where(c.in_flight[ks, None] >= need[None, :], vals, np.inf)
            best = vals.argmin(axis=0)
            better = vals[best, np.arange(R)] < dp[u, 1:]
            dp[u, 1:] = np.where(better, vals[best, np.arange(R)], dp[u, 1:])
            arg[u, 1:] = np.where(better, ks[best], -1)
        dps[j], args[j] = dp, arg
    return dps, args


def heuristic_chain(c: Candidates, U: int, counts: Sequence[int], M: int, T: float, weights: np.ndarray,
                    order: Optional[Sequence[int]] = None) -> Optional[list[int]]:
    """A memory-feasible chain with stages costing <= T that uses the fewest (weighted) devices; None when
    the chain found breaks a per-type device limit. Gives the MILP an incumbent to prune against. ``order``:
    pure stages, their device types in that order, each in one run (``ordered_chain_dp``)."""
    cost, ok = c.uses_matrix(len(counts)) @ weights, c.pace_s <= T
    if order is None:
        dp, arg = chain_dp(c, U, M, cost, ok)
        dps, args = [dp], [arg]
    else:
        dps, args = ordered_chain_dp(c, U, M, cost, ok, order)
    r = int(dps[0][0].argmin())
    if not np.isfinite(dps[0][0, r]):
        return None
    chain, u, j = [], 0, 0
    while u < U:
        k = int(args[j][u, r])
        if k < 0:  # this part of the chain starts with a later type
            j += 1
            continue
        chain.append(k)
        u, r = int(c.end_unit[k]), r - 1
    return chain if chain_is_feasible(c, chain, counts, M) else None


def counted_ordered_chain(c: Candidates, U: int, M: int, T: float, counts: Sequence[int], order: Sequence[int]
                          ) -> Optional[list[int]]:
    """The chain of least summed stage cost whose stages cost <= T, pure, their device types in ``order`` each in
    one run, and each type's stages within its device count: exact, where ``heuristic_chain``'s fewest devices are
    the fastest type's alone, past its count (on 8 A100 + 8 V100 every such chain wanted 13-16 A100s), and the
    chains that need both types were never tried. Only where
    every candidate of a type uses one device count (``--equal-widths``: one width), so a run's budget is a
    number of stages; None otherwise, or where no chain fits.

    dp[j][u, r, s]: the cheapest chain of r stages from unit u over types order[j:], at most s of them of type
    order[j]; arg: its first candidate, -1 where it starts with a later type."""
    uses = c.uses_matrix(len(counts))
    ok = c.pace_s <= T
    R, need = U, np.minimum(np.arange(1, U + 1), M)
    dps: list = [None] * len(order)
    args: list = [None] * len(order)
    budgets: list[int] = []
    for j in range(len(order) - 1, -1, -1):
        t = order[j]
        mine = ok & (c.type_idx == t) & (c.type2_idx < 0)
        per_stage = np.unique(uses[mine, t])
        if len(per_stage) > 1 or (len(per_stage) and per_stage[0] <= 0):
            return None
        S = int(counts[t] // per_stage[0]) if len(per_stage) else 0
        budgets.insert(0, S)
        dp = np.full((U + 1, R + 1, S + 1), np.inf)
        if j + 1 < len(order):
            dp[:, :, :] = dps[j + 1][:, :, -1][:, :, None]  # the run of order[j] empty from here on
        else:
            dp[U, 0, :] = 0.0
        arg = np.full((U + 1, R + 1, S + 1), -1)
        for u in range(U - 1, -1, -1):
            ks = np.flatnonzero(mine & (c.first_unit == u))
            if not len(ks) or S == 0:
                continue
            vals = np.full((len(ks), R + 1, S + 1), np.inf)
            vals[:, 1:, 1:] = c.cost_s[ks, None, None] + dp[c.end_unit[ks]][:, :R, :S]
            vals[:, 1:, :] = np.where((c.in_flight[ks, None] >= need[None, :])[:, :, None], vals[:, 1:, :], np.inf)
            best = vals.argmin(axis=0)
            take = np.take_along_axis(vals, best[None], axis=0)[0] < dp[u]
            dp[u] = np.where(take, np.take_along_axis(vals, best[None], axis=0)[0], dp[u])
            arg[u] = np.where(take, ks[best], arg[u])
        dps[j], args[j] = dp, arg
    return _walk(dps, args, budgets, c, U)


def _walk(dps: list, args: list, budgets: list[int], c: Candidates, U: int) -> Optional[list[int]]:
    """The chain ``counted_ordered_chain``'s tables hold from unit 0, its best number of stages."""
    r = int(dps[0][0, :, -1].argmin())
    if not np.isfinite(dps[0][0, r, -1]):
        return None
    chain, u, j, s = [], 0, 0, budgets[0]
    while u < U:
        k = int(args[j][u, r, s])
        if k < 0:  # this part starts with a later type, whose whole budget is left
            j += 1
            s = budgets[j]
            continue
        chain.append(k)
        u, r, s = int(c.end_unit[k]), r - 1, s - 1
    return chain


# --equal-widths' incumbents try every order of the device types up to this many types (4! = 24 orders)
MAX_ORDERED_TYPES = 4


def incumbent(c: Candidates, U: int, counts: Sequence[int], M: int, t_lb: float, one_run: bool = False
              ) -> Optional[list[int]]:
    """Best of a few heuristic chains at bottleneck thresholds a little above the lower bound. ``one_run``
    (``--equal-widths``): chains whose device types each serve one run of stages, in every order of the types
    (a chain that visits a type twice would be no incumbent of that search), and for each order the
    ``counted_ordered_chain``, which keeps every type within its count."""
    counts_a = np.asarray(counts, dtype=float)
    types = sorted(set(c.type_idx.tolist()))
    if not one_run:
        orders: list = [None]
    elif len(types) <= MAX_ORDERED_TYPES:
        orders = list(itertools.permutations(types))
    else:
        return None
    best, best_obj = None, math.inf
    values = np.unique(c.pace_s)
    for factor in (1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0, 3.0):
        T = values[min(np.searchsorted(values, t_lb * factor, side="right"), len(values)) - 1]
        found = [heuristic_chain(c, U, counts, M, T, weights, order)
                 for weights, order in itertools.product((1.0 / counts_a, np.ones_like(counts_a)), orders)]
        found += [counted_ordered_chain(c, U, M, T, counts, order) for order in orders if order is not None]
        for chain in found:
            if chain is not None:
                obj = objective_of(c, chain, M)
                if obj < best_obj:
                    best, best_obj = chain, obj
        if best is not None and factor >= 1.2:
            break
    return best


class _Milp(MilpModel):
    """The candidate-chain MILP for one micro-batch size, built row family by row family."""

    def __init__(self, c: Candidates, U: int, M: int, z_lower: float):
        super().__init__("hethub_plan")
        self.c, self.U, self.M = c, U, M
        n = len(c)
        self.x = [self.var(f"x{k}", cat=pulp.LpBinary) for k in range(n)]
        self.Z = self.var("Z", lowBound=z_lower)  # bottleneck per-micro-batch cost
        self.A = self.var("A", lowBound=0)  # slowest all-reduce
        self.O = self.var("O", lowBound=0)  # slowest optimizer step
        self.prob += (M - 1) * self.Z + self.affine([(k, float(c.cost_s[k])) for k in range(n)]) + self.A + self.O
        self.starts: list[list[int]] = [[] for _ in range(U + 1)]
        self.ends: list[list[int]] = [[] for _ in range(U + 1)]
        for k in range(n):
            self.starts[c.first_unit[k]].append(k)
            self.ends[c.end_unit[k]].append(k)

    def affine(self, terms) -> pulp.LpAffineExpression:
        return self.lin([(self.x[k], coef) for k, coef in terms])

    def flow_rows(self) -> None:
        """One chain of candidates from boundary 0 to boundary U."""
        lpSum, x = pulp.lpSum, self.x
        self.prob += lpSum(x[k] for k in self.starts[0]) == 1
        self.prob += lpSum(x[k] for k in self.ends[self.U]) == 1
        for p in range(1, self.U):
            self.prob += lpSum(x[k] for k in self.ends[p]) == lpSum(x[k] for k in self.starts[p])

    def load_rows(self) -> None:
        """Running loads y[u] = value of the stage covering unit u (for c, ar, opt); bottleneck rows per unit."""
        c = self.c
        self.loads: dict[str, list] = {}
        for top, vals, name in ((self.Z, c.pace_s, "c"), (self.A, c.allreduce_s, "ar"), (self.O, c.optimizer_s, "opt")):
            prev = None
            self.loads[name] = []
            for u in range(self.U):
                y = self.var(f"y_{name}_{u}", lowBound=0)
                self.loads[name].append(y)
                expr = self.affine([(k, float(vals[k])) for k in self.starts[u]] +
                                   [(k, -float(vals[k])) for k in self.ends[u]])
                self.prob += (y == (prev if prev is not None else 0) + expr)
                self.prob += top >= y
                prev = y

    def vendor_rows(self) -> None:
        """A boundary between vendors: z[p] = 1 when the stage ending at p and the one starting there differ
        in vendor; q[p] >= the ending stage's bridge penalty then, added to its cost (sum and bottleneck)."""
        c = self.c
        vendors = set(c.vendor.tolist())
        if len(vendors) <= 1:
            return
        for p in range(1, self.U):
            if not self.ends[p] or not self.starts[p]:
                continue
            z = self.var(f"z_{p}", lowBound=0, upBound=1)
            for vid in vendors:
                e_v = [(k, 1.0) for k in self.ends[p] if c.vendor[k] == vid]
                s_v = [(k, -1.0) for k in self.starts[p] if c.vendor[k] == vid]
                if e_v:
                    self.prob += z >= self.affine(e_v + s_v)
            self._charge_ending_stage(p, z, c.bridge_s, c.bridged_pace_s, "q")

    def host_rows(self) -> None:
        """A boundary between hosts: y[p] = 1 unless the stage ending at p and the one starting there are pure stages
        of one device type; h[p] >= the ending stage's inter-node price then (``Candidates.hop_s``)."""
        c = self.c
        for p in range(1, self.U):
            if not self.ends[p] or not self.starts[p]:
                continue
            hmax = float(max(c.hop_s[k] for k in self.ends[p]))
            if hmax <= 0:
                continue
            y = self.var(f"y_{p}", lowBound=0, upBound=1)
            for t in set(c.type_idx[k] for k in self.ends[p]):
                e_t = [(k, 1.0) for k in self.ends[p] if c.type_idx[k] == t]
                s_t = [(k, -1.0) for k in self.starts[p] if c.type_idx[k] == t and c.type2_idx[k] < 0]
                self.prob += y >= self.affine(e_t + s_t)
            self._charge_ending_stage(p, y, c.hop_s, c.hopped_pace_s, "h")

    def type_run_rows(self) -> None:
        """Each device type enters the chain once (``one_run_per_type``, for ``--equal-widths``): e[t, p] >= the
        stages of t starting at boundary p less those ending there, and the e[t, p] of a type sum to at most 1."""
        c = self.c
        types = sorted(set(c.type_idx.tolist()) | set(int(t) for t in c.type2_idx if t >= 0))
        for t in types:
            entries = []
            for p in range(self.U):
                s_t = [(k, 1.0) for k in self.starts[p] if t in (c.type_idx[k], c.type2_idx[k])]
                if not s_t:
                    continue
                e_t = [(k, -1.0) for k in self.ends[p] if t in (c.type_idx[k], c.type2_idx[k])]
                enter = self.var(f"enter_{t}_{p}", lowBound=0)
                self.prob += enter >= self.affine(s_t + e_t)
                entries.append(enter)
            if len(entries) > 1:
                self.prob += pulp.lpSum(entries) <= 1

    def _charge_ending_stage(self, p: int, flag, price_s: np.ndarray, pace_s: np.ndarray, name: str) -> None:
        """Where ``flag`` (in [0, 1]) is 1 at boundary p, the stage ending there pays ``price_s`` more in the sum and
        is held to ``pace_s`` in the bottleneck (both rows vacuous where the flag is 0); nothing where no ending
        stage has a price."""
        ends = self.ends[p]
        pmax = float(max(price_s[k] for k in ends))
        if pmax <= 0:
            return
        extra = self.var(f"{name}_{p}", lowBound=0)
        self.prob += extra >= self.affine([(k, float(price_s[k])) for k in ends]) - pmax * (1 - flag)
        self.prob.objective += extra
        bmax = float(max(pace_s[k] for k in ends))
        self.prob += self.Z >= self.affine([(k, float(pace_s[k])) for k in ends]) - bmax * (1 - flag)

    def memory_rows(self) -> None:
        """Stages remaining from boundary u: r[u] = r[u+1] + (stages starting at u); a candidate that holds
        only k < M micro-batches in flight needs r[u] <= k."""
        r_next = None
        for u in range(self.U - 1, -1, -1):
            r = self.var(f"r_{u}", lowBound=0)
            self.prob += r == (r_next if r_next is not None else 0) + pulp.lpSum(self.x[k] for k in self.starts[u])
            tight = [k for k in self.starts[u] if self.c.in_flight[k] < self.M]
            if tight:
                self.prob += r + self.affine([(k, float(self.U - self.c.in_flight[k])) for k in tight]) <= self.U
            r_next = r

    def device_rows(self, counts: Sequence[int]) -> None:
        for ti, cnt in enumerate(counts):
            use = self.c.uses(ti)
            ks = np.flatnonzero(use)
            if len(ks):
                self.prob += self.affine([(k, float(use[k])) for k in ks]) <= cnt


def solve_milp(c: Candidates, U: int, counts: Sequence[int], M: int, solver: str, time_limit_s: float,
               z_lower: float = 0.0, cutoff: Optional[float] = None, one_run: bool = False
               ) -> tuple[Optional[list[int]], float, float, str]:
    """(chosen candidates in order or None, objective, lower bound, status: optimal|feasible|infeasible|timeout).

    ``cutoff``: only solutions below it are of interest (an incumbent from another micro-batch size).
    ``one_run``: every device type serves one run of consecutive stages (``one_run_per_type``).

    ``z_lower`` is a valid lower bound on the bottleneck (``bottleneck_lower_bound``): with it the LP
    relaxation no longer spreads a fraction of every stage thin to make the bottleneck look cheap.
    """
    if len(c) == 0:
        return None, math.inf, math.inf, "infeasible"
    milp = _Milp(c, U, M, z_lower)
    milp.flow_rows()
    milp.load_rows()
    milp.vendor_rows()
    milp.host_rows()
    milp.memory_rows()
    milp.device_rows(counts)
    if one_run:
        milp.type_run_rows()
    out = milp.solve(solver, time_limit_s, cutoff)
    if not out.solved:
        return None, math.inf, out.bound, out.status
    chosen = sorted((k for k in range(len(c)) if (milp.x[k].value() or 0) > 0.5), key=lambda k: c.first_unit[k])
    obj = objective_of(c, chosen, M)
    return chosen, obj, (obj if out.status == "optimal" else min(out.bound, obj)), out.status


def solve_brute_force(c: Candidates, U: int, counts: Sequence[int], M: int, max_nodes: int = 20_000_000,
                      deadline: float = math.inf, time_limit_s: float = math.inf, one_run: bool = False
                      ) -> Optional[tuple[list[int], float]]:
    """Enumerate every chain of candidates (small instances only): the reference for the MILP.

    Depth-first over chains, pruning only what cannot matter: a partial chain that already uses more
    devices of a type than exist, or whose partial objective (every term only grows as stages are
    added) already reaches the best complete chain's.
    """
    starts: list[list[int]] = [[] for _ in range(U + 1)]
    for k in np.argsort(c.cost_s, kind="stable"):
        starts[c.first_unit[k]].append(int(k))
    cc, ar, opt = c.cost_s.tolist(), c.allreduce_s.tolist(), c.optimizer_s.tolist()
    pc, hpc, bpc = c.pace_s.tolist(), c.hopped_pace_s.tolist(), c.bridged_pace_s.tolist()
    w, t = (c.width * c.tp).tolist(), c.type_idx.tolist()
    w2, t2 = (c.width2 * c.tp2).tolist(), c.type2_idx.tolist()  # a mixed stage's second type (-1: none)
    vend, pen, hop = c.vendor.tolist(), c.bridge_s.tolist(), c.hop_s.tolist()
    used = [0] * len(counts)
    best: list = [None, math.inf]
    nodes = [0]

    def walk(u: int, chain: list[int], mx: float, sm: float, mar: float, mop: float):
        # mx/sm count every stage's cost; the last stage's host and bridge penalties are added once its successor
        # is known
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
            if chain_is_feasible(c, chain, counts, M) and (not one_run or one_run_per_type(c, chain)):
                best[0], best[1] = list(chain), (M - 1) * mx + sm + mar + mop
            return
        for k in starts[u]:
            if used[t[k]] + w[k] > counts[t[k]] or (t2[k] >= 0 and used[t2[k]] + w2[k] > counts[t2[k]]):
                continue
            used[t[k]] += w[k]
            used[t2[k]] += w2[k]  # 0 (on the last type) for a pure stage
            bridged = bool(chain) and vend[chain[-1]] != vend[k]
            hopped = bool(chain) and (t[chain[-1]] != t[k] or t2[k] >= 0)
            extra = (pen[chain[-1]] if bridged else 0.0) + (hop[chain[-1]] if hopped else 0.0)
            prev_pace = bpc[chain[-1]] if bridged else hpc[chain[-1]] if hopped else 0.0
            chain.append(k)
            walk(int(c.end_unit[k]), chain, max(mx, pc[k], prev_pace), sm + cc[k] + extra, max(mar, ar[k]),
                 max(mop, opt[k]))
            chain.pop()
            used[t[k]] -= w[k]
            used[t2[k]] -= w2[k]

    walk(0, [], 0.0, 0.0, 0.0, 0.0)
    return None if best[0] is None else (best[0], objective_of(c, best[0], M))
