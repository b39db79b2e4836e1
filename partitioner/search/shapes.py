"""Layer-granular planning for models whose blocks are identical: a MILP over stage *shapes*, not chains.

Why: the chain MILP (``search.chain.solve_milp``) has one binary per (layer range, device type, width, tensor
parallel, recompute); at 160 blocks that is ~13,000 ranges times the configurations, so large models were
cut into 4-block units — which is what kept HETHUB-like plans away from their balance point. When every
block costs the same (every built-in model and every Hugging Face decoder), a middle stage's cost, memory
and synchronisation depend only on how many blocks it holds and its configuration, not on where it sits,
except through 1F1B's in-flight count. So:

- a *shape* is a candidate over one of the ranges (0, j) [first stage: embedding + j-1 blocks; j = all
  layers is a one-stage plan], (1, 1 + m) [a middle stage of m blocks] or (i, n) [last stage: blocks + head];
- integer n_k counts how many middle stages of shape k the plan has, binaries pick the first and last;
- blocks add up to the model's, devices per type to at most the cluster's;
- 1F1B memory is a matching of stages to positions (the stage p-th from the end keeps min(p, M)
  micro-batches in flight): by Hall's theorem on these nested sets it holds iff for every k < M at most k
  of the stages after the first fit only <= k in flight, and the first stage fits min(S, M);
- the bottleneck, all-reduce and optimizer terms are maxima over shapes in use (u_k = [n_k >= 1]).

The cross-vendor bridge penalty and the inter-node price of a boundary between device types (a host holds
one type) depend on the order, which the counts do not fix: the MILP charges only what every order pays
(one bridge per vendor run, one boundary per type's run but the last, two runs for the type of both the
first and the last stage), so its bound stays valid, and the chain is then ordered — the stages by in-flight
capacity, grouped by vendor (and within a vendor by type) where memory allows — and priced exactly with
``search.candidates.objective_of``.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import Callable, Optional, Sequence

import numpy as np

import pulp

from ..costmodel import CostModel
from ..evaluate import REPLAY_WITHIN
from .candidates import (FIELDS, Candidates, Job, Solution, candidates, chain_is_feasible, objective_of,
                         tensor_parallel_degrees)
from .milp import OPTIMAL_GAP, MilpModel


def identical_blocks(cm: CostModel, types: Sequence[str], max_tp: int) -> bool:
    """Whether every block (planner layers 1 .. n-2) costs the same on every type and degree: what makes a
    stage's cost depend only on its block count."""
    n = cm.model.num_planner_layers
    if n < 4:
        return False
    blocks = slice(1, n - 1)
    lay = cm.layers
    arrays = [lay.params, lay.act_bytes, lay.act_bytes_recompute, lay.out_bytes, lay.params_split, lay.act_split]
    for t in types:
        for tp in tensor_parallel_degrees(cm, t, max_tp):
            arrays.extend(cm.layer_times(t, tp))
    for a in arrays:
        v = np.asarray(a, dtype=float)[blocks]
        if np.ptp(v) > 1e-9 * max(1.0, float(np.abs(v).max())):
            return False
    return True


def shape_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(first layer, end layer) of every shape: first stages (0, j), middle stages (1, 1 + m), last (i, n)."""
    first = [(0, j) for j in range(1, n + 1)]
    middle = [(1, 1 + m) for m in range(1, n - 1)]
    last = [(i, n) for i in range(1, n)]
    pairs = np.array(first + middle + last)
    return pairs[:, 0], pairs[:, 1]


def shape_blocks(c: Candidates, n: int) -> np.ndarray:
    """Blocks each shape holds: a first stage (0, j) j - 1 (the embedding is layer 0), a last stage (i, n)
    n - 1 - i (the head is layer n - 1), a middle stage its range, a one-stage plan all n - 2."""
    first, end = c.first_unit, c.end_unit
    is_last = (end == n) & (first > 0)
    blocks = np.where(first == 0, end - 1, np.where(is_last, n - 1 - first, end - first))
    return np.where((first == 0) & (end == n), n - 2, blocks)


def shape_candidates(cm: CostModel, b: int, M: int, types: Sequence[str], counts: dict[str, int],
                     allow_recompute: bool, max_tp: int, mixed: bool = True, schedule: str = "1f1b",
                     zero1: bool = False, overlap: bool = True) -> Candidates:
    n = cm.model.num_planner_layers
    units = [(l, l + 1) for l in range(n)]
    return candidates(cm, units, b, M, types, counts, allow_recompute, max_tp=max_tp, pairs=shape_pairs(n),
                      mixed=mixed, schedule=schedule, zero1=zero1, overlap=overlap)


def blocks_lower_bound(c: Candidates, n: int, counts: Sequence[int], M: int,
                       sample_s: Optional[Sequence[float]] = None) -> float:
    """Smallest bottleneck T such that stages costing <= T could hold every block with the devices there are
    (per type): a valid lower bound on any plan's bottleneck. Per type a knapsack: the most blocks ``d``
    devices of the type can hold, with at most one first stage and one last stage (their blocks less the
    embedding and head). (Middle stages alone left the bound invalid where a first stage of k blocks paces
    faster than a middle one of k: under ``--network no-overlap`` it has no input transfers to charge, and
    a capped MILP held a 32 A100 + 96 V100 plan's bottleneck 3.7% above its own, proving a 1.2% worse plan
    optimal.) 1F1B position enters through multiplicity:
    a stage that holds only f < M micro-batches in flight must sit among the last f positions, so a plan has
    at most f stages of that shape (without this the bound lets every stage be the densest, memory-starved
    shape, and on the 768-device benchmark the capped MILPs spent their time proving caps up to 1.1x the
    bound infeasible).

    A mixed-type stage is split into one item per type, its blocks shared in proportion to the speed of its
    devices (``sample_s``: seconds per sample per type; default equal). Any split keeps the bound valid: in a
    plan, each type's parts use exactly that type's devices, and the parts add up to the stage's blocks."""
    holds = blocks_fit(c, n, counts, M, sample_s)
    values = np.unique(c.pace_s)
    if not len(values) or not holds(c.pace_s <= values[-1]):
        return math.inf
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid_i = (lo + hi) // 2
        if holds(c.pace_s <= values[mid_i]):
            hi = mid_i
        else:
            lo = mid_i + 1
    return float(values[lo])


def blocks_fit(c: Candidates, n: int, counts: Sequence[int], M: int, sample_s: Optional[Sequence[float]] = None
               ) -> Callable[[np.ndarray], bool]:
    """``holds(ok)``: whether middle shapes among ``ok``, in whole copies, could hold every block with the devices
    there are (``blocks_lower_bound``'s knapsack, per type; false proves no plan uses only such shapes)."""
    L = n - 2
    mid = (c.first_unit == 1) & (c.end_unit < n)
    ends = ((c.first_unit == 0), (c.end_unit == n) & (c.first_unit > 0))  # first (one-stage plans too), last
    blocks = shape_blocks(c, n).astype(float)
    speed = 1.0 / np.asarray(sample_s if sample_s is not None else np.ones(len(counts)), dtype=float)
    d_a, d_b = c.width * c.tp, c.width2 * c.tp2
    w_a = d_a * speed[c.type_idx]
    w_b = np.where(c.type2_idx >= 0, d_b * speed[np.maximum(c.type2_idx, 0)], 0.0)
    share_a = blocks * w_a / (w_a + w_b)  # the whole stage for a pure one
    items = [(c.type_idx, d_a, share_a), (c.type2_idx, d_b, blocks - share_a)]
    flight = c.in_flight.astype(int)

    def holds(ok: np.ndarray) -> bool:
        total = 0.0
        for ti, cnt in enumerate(counts):
            best: dict[tuple[int, int], float] = {}  # per (devices, in-flight count), the most blocks one item holds
            for of, dev, val in items:
                sel = np.flatnonzero(mid & (of == ti) & ok & (dev > 0) & (dev <= cnt))
                for d, f, m in zip(dev[sel].tolist(), flight[sel].tolist(), val[sel].tolist()):
                    best[d, f] = max(best.get((d, f), 0.0), m)
            g = np.zeros(cnt + 1)
            for (d, f), m in _undominated(best):
                g = _take_any_number(g, d, m) if f >= M or f * d >= cnt else _take_up_to(g, d, m, f)
            for kind in ends:  # one of them at most, whichever fits best
                one: dict[int, float] = {}
                for of, dev, val in items:
                    sel = np.flatnonzero(kind & (of == ti) & ok & (dev > 0) & (dev <= cnt))
                    for d, m in zip(dev[sel].tolist(), val[sel].tolist()):
                        one[d] = max(one.get(d, 0.0), m)
                g = _take_one_of(g, one)
            total += float(g[cnt])
            if total >= L - 1e-9:
                return True
        return False

    return holds


def _take_one_of(g: np.ndarray, items: dict[int, float]) -> np.ndarray:
    """Group knapsack step: g[x] = max(g[x], max over the items (d devices, m blocks) of g[x - d] + m)."""
    out = g.copy()
    for d, m in items.items():
        if d < len(g):
            out[d:] = np.maximum(out[d:], g[:len(g) - d] + m)
    return out


def _undominated(best: dict[tuple[int, int], float]) -> list[tuple[tuple[int, int], float]]:
    """Items (devices, in-flight count) -> blocks without those another item of the same devices beats in both
    blocks and in-flight count (it could take their place in any plan)."""
    out = []
    for (d, f), m in sorted(best.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        if out and out[-1][0][0] == d and out[-1][1] >= m:
            continue
        out.append(((d, f), m))
    return out


def _take_up_to(g: np.ndarray, d: int, m: float, f: int) -> np.ndarray:
    """Bounded knapsack step: g[x] = max over 0 <= k <= f of g[x - k d] + k m, as 0/1 items of 1, 2, 4, ...
    copies (binary splitting: every k <= f is a sum of a subset of them, and no subset exceeds f)."""
    left, size = f, 1
    while left > 0:
        k = min(size, left)
        shift = k * d
        if shift < len(g):
            g = np.concatenate([g[:shift], np.maximum(g[shift:], g[:-shift] + k * m)])
        left -= k
        size *= 2
    return g


def _take_any_number(g: np.ndarray, d: int, m: float) -> np.ndarray:
    """Unbounded knapsack step: g[x] = max over k >= 0 of g[x - k d] + k m (an item of d devices holding m
    blocks, taken any number of times). Per residue of x mod d a running maximum of g[r + j d] - j m, so
    one vectorised pass instead of a loop over x."""
    n = len(g)
    rows = -(-n // d)
    padded = np.full(rows * d, -np.inf)
    padded[:n] = g
    grid = padded.reshape(rows, d)
    j = np.arange(rows, dtype=float)[:, None] * m
    return (np.maximum.accumulate(grid - j, axis=0) + j).ravel()[:n]


def blocks_sum_lower_bound(c: Candidates, n: int) -> float:
    """A lower bound on the sum of stage costs: every block, at the lowest cost per block any stage has
    (a stage's cost is at least its blocks times its own cost per block; the embedding and head add)."""
    first, end = c.first_unit, c.end_unit
    blocks = np.minimum(end, n - 1) - np.maximum(first, 1)
    ok = blocks > 0
    if not ok.any():
        return 0.0
    return float((n - 2) * (c.cost_s[ok] / blocks[ok]).min())


class DualBound:
    """A lower bound on the objective of every plan of one micro-batch size, by regions of (bottleneck, all-reduce).

    Why: the shape MILP links its bottleneck Z and all-reduce A to the shapes in use through big-M rows
    (Z >= pace_k u_k), whose LP relaxation is weak; at HETHUB's scale a size it cannot finish in time kept a
    bound 8-14% under the plans it found. Here Z and A are fixed to ranges instead: every plan whose bottleneck
    lies in [T_lo, T_hi] and all-reduce in [a_lo, a_hi] uses only shapes pacing <= T_hi with an all-reduce
    <= a_hi, so it costs at least (M - 1) T_lo + a_lo + the least optimizer step of those shapes + a bound on its
    sum of stage costs over them. That sum is bounded by the Lagrangian dual of its LP (blocks add up to the
    model's, one first and one last stage, devices per type within the cluster's, a shape fitting f < M
    micro-batches in flight used at most f times): any multipliers give a valid bound, none needs a solver.
    Regions are split, lowest bound first, until every region reaches the cutoff or the budget ends; the
    bound is the least over the regions left. (The charges for crossing hosts or vendors are >= 0: left out.)
    """

    def __init__(self, c: Candidates, n: int, counts: Sequence[int], M: int, t_lb: float,
                 sample_s: Optional[Sequence[float]] = None):
        self.c, self.M, self.L = c, M, n - 2
        self.fits = blocks_fit(c, n, counts, M, sample_s)
        first, end = c.first_unit, c.end_unit
        self.is_first, self.is_last = (first == 0) & (end < n), (end == n) & (first > 0)
        self.is_mid = (first > 0) & (end < n)
        self.blocks = shape_blocks(c, n).astype(float)
        self.use = c.uses_matrix(len(counts)).astype(float)
        self.cnt = np.asarray(counts, dtype=float)
        ub = np.minimum(self.L // np.maximum(self.blocks, 1), M + self.L).astype(float)
        for ti, cnt in enumerate(counts):
            ub = np.where(self.use[:, ti] > 0, np.minimum(ub, cnt // np.maximum(self.use[:, ti], 1)), ub)
        self.ub = np.where(c.in_flight < M, np.minimum(ub, c.in_flight), ub)
        whole = np.flatnonzero((first == 0) & (end == n) & (self.use <= self.cnt).all(axis=1))
        self.whole_s = min((objective_of(c, [k], M) for k in whole), default=math.inf)  # one-stage plans, exactly
        self.paces = np.unique(c.pace_s[c.pace_s >= t_lb * (1 - 1e-9)])
        self.allreduces = np.unique(c.allreduce_s)
        scale = float(np.median(c.cost_s / np.maximum(c.devices, 1)))
        self.lam0 = np.full(len(counts), scale)

    def subset(self, ok: np.ndarray) -> Optional[list[tuple[np.ndarray, ...]]]:
        """(cost, devices per type, blocks, most copies) of the first, last and middle shapes among ``ok``;
        None when there is no first or no last one."""
        parts = [np.flatnonzero(ok & kind) for kind in (self.is_first, self.is_last, self.is_mid)]
        if not len(parts[0]) or not len(parts[1]):
            return None
        return [(self.c.cost_s[k], self.use[k], self.blocks[k], self.ub[k]) for k in parts]

    def dual(self, sub: list[tuple[np.ndarray, ...]], lam: np.ndarray) -> float:
        """The Lagrangian of the sum-of-costs LP over the shapes ``sub`` at device prices ``lam``, maximised over
        the price of a block (mu) at the breakpoints near its optimum; inf where they cannot hold the model."""
        (cf, uf, bf, _), (cl, ul, bl, _), (cm, umid, bm, um) = sub
        rf, rl, rm = cf + uf @ lam, cl + ul @ lam, cm + umid @ lam
        order = np.argsort(rm / bm)
        ratio = (rm / bm)[order]
        held = np.r_[0.0, np.cumsum((um * bm)[order])]  # blocks the mids cheaper than each ratio can hold
        if held[-1] + bf.max() + bl.max() < self.L:
            return math.inf
        # the optimum mu is where held + the end stages' blocks reach L: breakpoints around there
        lo = max(0, int(np.searchsorted(held, self.L - bf.max() - bl.max())) - 1)
        hi = min(len(ratio), int(np.searchsorted(held, self.L)) + 1)
        mus = np.r_[0.0, ratio[lo:hi]]
        j = np.r_[0, np.arange(lo, hi)]  # mids strictly below mus[i]: the first j of them
        cost_below = np.r_[0.0, np.cumsum((um * rm)[order])][j]
        D = (mus * self.L - lam @ self.cnt + (rf[None, :] - mus[:, None] * bf[None, :]).min(axis=1)
             + (rl[None, :] - mus[:, None] * bl[None, :]).min(axis=1) + cost_below - mus * held[j])
        return float(D.max())

    def best_dual(self, sub: list[tuple[np.ndarray, ...]], lam: np.ndarray, step: float
                  ) -> tuple[float, np.ndarray]:
        """Pattern search over the device prices from ``lam``, first moves by factors of 1 + ``step`` (the dual is
        concave in them)."""
        best = self.dual(sub, lam)
        while step > 0.06 and math.isfinite(best):
            moved = False
            for t in range(len(lam)):
                for f in (1 + step, 1 / (1 + step), 0.0):
                    trial = lam.copy()
                    trial[t] = lam[t] * f if lam[t] > 0 or f == 0 else self.lam0[t] * step
                    if trial[t] > 1e6 * self.lam0[t]:  # the devices cannot hold the model: any bound will do
                        continue
                    v = self.dual(sub, trial)
                    if v > best + 1e-12:
                        best, lam, moved = v, trial, True
                        break
            if not moved:
                step /= 2
        return best, lam

    def allowed(self, box: tuple[int, int, int, int]) -> np.ndarray:
        """The shapes a plan of the region may use: pacing and all-reducing within its tops."""
        c = self.c
        return (c.pace_s <= self.paces[box[1]] * (1 + 1e-12)) & (c.allreduce_s <= self.allreduces[box[3]] * (1 + 1e-12))

    def region(self, box: tuple[int, int, int, int], lam: np.ndarray, step: Optional[float]
               ) -> tuple[float, np.ndarray]:
        """The bound over plans with bottleneck in paces[i0..i1] and all-reduce in allreduces[j0..j1], at device
        prices ``lam`` (tuned from there when ``step`` is given)."""
        i0, i1, j0, j1 = box
        c = self.c
        ok = self.allowed(box)
        sub = self.subset(ok)
        if sub is None:
            return math.inf, lam
        g, lam = self.best_dual(sub, lam, step) if step is not None else (self.dual(sub, lam), lam)
        opt = float(c.optimizer_s[ok].min())
        return (self.M - 1) * self.paces[i0] + self.allreduces[j0] + opt + g, lam

    def bound(self, cutoff: float, budget_s: float) -> float:
        """The least region bound once every region reaches ``cutoff`` or ``budget_s`` is spent (never above
        the one-stage plans' exact price). A region split off takes its parent's device prices; they are tuned
        only when it comes up again (most parts are dropped before that)."""
        if not len(self.paces):
            return self.whole_s
        t_end = time.perf_counter() + budget_s
        top_i, top_j = len(self.paces) - 1, len(self.allreduces) - 1
        if math.isfinite(cutoff):  # a plan below the cutoff has (M - 1) Z + A below it
            top_i = max(0, int(np.searchsorted(self.paces, cutoff / max(1, self.M - 1), side="right")) - 1)
            top_j = max(0, int(np.searchsorted(self.allreduces, cutoff, side="right")) - 1)
        root = (0, top_i, 0, top_j)
        v, lam = self.region(root, self.lam0, step=1.0)
        heap = [(v, 0, root, lam, True)]  # (bound, tie-break, box, device prices, tuned)
        pushed = 1
        while heap and heap[0][0] < cutoff and time.perf_counter() < t_end:
            v, _, box, lam, tuned = heapq.heappop(heap)
            if not tuned:
                tv, lam = self.region(box, lam, step=0.25)
                if math.isfinite(tv):
                    heapq.heappush(heap, (max(tv, v), pushed, box, lam, True))
                    pushed += 1
                continue
            if not self.fits(self.allowed(box)):  # whole copies of its shapes cannot hold the model: no plan there
                continue
            i0, i1, j0, j1 = box
            if i0 == i1 and j0 == j1:  # a single point: cannot be split
                heapq.heappush(heap, (v, 0, box, lam, True))
                break
            split_t = (self.M - 1) * (self.paces[i1] - self.paces[i0]) >= self.allreduces[j1] - self.allreduces[j0]
            if split_t and i1 > i0 or j1 == j0:
                mid = (i0 + i1) // 2
                halves = [(i0, mid, j0, j1), (mid + 1, i1, j0, j1)]
            else:
                mid = (j0 + j1) // 2
                halves = [(i0, i1, j0, mid), (i0, i1, mid + 1, j1)]
            for h in halves:
                hv, _ = self.region(h, lam, step=None)
                if math.isfinite(hv):  # a part's bound is at least its whole's
                    heapq.heappush(heap, (max(hv, v), pushed, h, lam, False))
                    pushed += 1
        # plans beyond the top region cost more than the cutoff
        return float(min(heap[0][0] if heap else math.inf, cutoff, self.whole_s))


class ShapeMilp(MilpModel):
    """The counts MILP over shape candidates ``c`` for one micro-batch size and one order of the vendors.

    The stages form one run per vendor, in ``vendor_order`` (vendors the plan leaves out have empty runs):
    a run that has a later non-empty run ends with a stage that pays the bridge penalty. Memory per run:
    its stages sit after every stage of the later runs, so for a shape k in use, the run's stages that fit
    no more than k's in-flight count, plus all later stages, number at most that count (Hall's condition,
    run by run; the last stage is always last); a run's bridge stage sits right after the later runs.
    """

    def __init__(self, c: Candidates, n: int, counts: Sequence[int], M: int, vendor_order: Sequence[int],
                 z_lower: float = 0.0, z_upper: Optional[float] = None):
        super().__init__("hethub_shapes")
        self.c, self.n, self.M = c, n, M
        L = n - 2
        prob, var, lin = self.prob, self.var, self.lin
        first, end = c.first_unit, c.end_unit
        self.is_first = first == 0
        self.is_last = (end == n) & (first > 0)
        self.is_whole = self.is_first & (end == n)
        self.is_mid = ~self.is_first & ~self.is_last
        blocks = shape_blocks(c, n)
        order = [int(v) for v in vendor_order]
        use = c.uses_matrix(len(counts))
        self.x, self.u = {}, {}
        for k in range(len(c)):
            if int(c.vendor[k]) not in order:
                continue
            if self.is_mid[k]:
                ub = min([L // int(blocks[k]), M + L] + [cnt // int(use[k, ti]) for ti, cnt in enumerate(counts)
                                                          if use[k, ti]])
                if ub < 1:
                    continue
                self.x[k] = var(f"n{k}", lowBound=0, upBound=ub, cat=pulp.LpInteger)
                self.u[k] = var(f"u{k}", cat=pulp.LpBinary)
                prob += self.x[k] <= ub * self.u[k]
            else:
                self.x[k] = self.u[k] = var(f"y{k}", cat=pulp.LpBinary)
        ks = self.ks = list(self.x)
        Z, A, O = var("Z", lowBound=z_lower, upBound=z_upper), var("A", lowBound=0), var("O", lowBound=0)
        prob += (M - 1) * Z + lin([(self.x[k], float(c.cost_s[k])) for k in ks]) + A + O
        for k in ks:
            for top, vals in ((Z, c.pace_s), (A, c.allreduce_s), (O, c.optimizer_s)):
                if vals[k] > 0:
                    prob += top >= float(vals[k]) * self.u[k]
        ends = [k for k in ks if not self.is_mid[k]]
        prob += lin([(self.x[k], 1.0) for k in ends if self.is_first[k]]) == 1
        prob += lin([(self.x[k], 1.0) for k in ends if self.is_last[k] or self.is_whole[k]]) == 1
        prob += lin([(self.x[k], float(blocks[k])) for k in ks]) == L
        for ti, cnt in enumerate(counts):
            terms = [(self.x[k], float(use[k, ti])) for k in ks if use[k, ti]]
            if terms:
                prob += lin(terms) <= cnt
        self._runs(var, lin, Z, order)
        self._host_changes(var, lin, Z)
        # The first stage keeps min(S, M) in flight, S = 2 + middle stages (1 for a one-stage plan). The sum
        # is one variable, so that each first-stage row has three terms, not one per middle shape.
        stages = var("middles", lowBound=0)
        prob += stages == lin([(self.x[k], 1.0) for k in ks if self.is_mid[k]])
        big = M + L
        for k in ends:
            if self.is_first[k] and not self.is_whole[k] and c.in_flight[k] < M:
                prob += stages + 2 <= float(c.in_flight[k]) + big * (1 - self.x[k])

    def _host_changes(self, var, lin, Z) -> None:
        """Every device type the plan uses, but the last stage's, ends a run of stages followed by another type's,
        on other hosts: one of its stages pays the inter-node price (``Candidates.hop_s``; 0 where it paid it
        already). So does the last stage's type when it also holds the first stage and another type is used (it
        then has two runs). At least that whatever the order, so the objective stays a lower bound. The bottleneck
        Z holds the paying stages' paces with the price (``hopped_pace_s``), weighted by their share of the charge:
        an ordered chain holds its one paying stage's in full. (Without it, under ``--network no-overlap``, where
        the price is on the path, a slice's MILP valued a 21-stage chain at 0.668 s that ordered costs 0.784 s,
        and 64 A100 + 64 V100 ended every search at a 3.0% gap.)"""
        c, prob, ks = self.c, self.prob, self.ks
        kinds = sorted({int(c.type_idx[k]) for k in ks})
        charged = [t for t in kinds if any(c.hop_s[k] > 0 for k in ks if c.type_idx[k] == t)]
        if not charged:
            return
        used = {t: var(f"tused{t}", lowBound=0, upBound=1) for t in kinds}
        hopped = c.hopped_pace_s  # a property over every candidate: computed once, not per stage
        for k in ks:
            prob += used[int(c.type_idx[k])] >= self.u[k]
        for t in charged:
            of_t = [k for k in ks if c.type_idx[k] == t]
            # a run ends before another stage: never at the last stage
            ending = [k for k in of_t if not (self.is_last[k] or self.is_whole[k])]
            free = var(f"tfree{t}", lowBound=0, upBound=1)  # a used stage of the type that needs no extra price
            # (counts, not the used flags: a flag may be set on a shape the plan holds none of); a first stage's
            # share of it is ``first_free``'s, which ``_first_pays_alone`` bounds
            first_free = [(self.x[k], 1.0) for k in ending if c.hop_s[k] <= 0 and self.is_first[k]]
            alone = var(f"tfirstfree{t}", lowBound=0, upBound=1) if first_free else 0.0
            prob += free <= lin([(self.x[k], 1.0) for k in ending if c.hop_s[k] <= 0 and not self.is_first[k]]) + alone
            if first_free:
                prob += alone <= lin(first_free)
            # continuous: at an optimum the cheapest used stage of the type takes the charge
            gamma = {k: var(f"g{k}", lowBound=0, upBound=1) for k in ending if c.hop_s[k] > 0}
            for k, g in gamma.items():
                prob += g <= self.x[k]
            if gamma:
                prob += Z >= lin([(g, float(hopped[k])) for k, g in gamma.items()])
            last = [(self.x[k], 1.0) for k in of_t if self.is_last[k] or self.is_whole[k]]
            self._first_pays_alone(var, lin, t, of_t, [g for k, g in gamma.items() if self.is_first[k]]
                                   + ([alone] if first_free else []), last)
            ends = lin([(g, 1.0) for g in gamma.values()]) + free
            prob += ends + lin(last) >= used[t]
            first = [(self.x[k], 1.0) for k in of_t if self.is_first[k] and not self.is_whole[k]]
            if first and len(kinds) > 1:
                other = var(f"tother{t}", lowBound=0, upBound=1)  # another type is used
                for q in kinds:
                    if q != t:
                        prob += other >= used[q]
                prob += ends >= lin(first + last) + other - 2
            prob.objective += lin([(g, float(c.hop_s[k])) for k, g in gamma.items()])

    def _first_pays_alone(self, var, lin, t: int, of_t: list[int], firsts: list, last: list) -> None:
        """The first stage ends its type's run only when no middle stage of the type is used, unless the type
        also holds the last stage (its middles may then sit before it, the first stage alone in its run):
        ``firsts``, the first stage's share of the run's end, paid or free, is at most that. (Ending it, the first
        stage let the MILP value 8 A100 + 8 V100 chains, where a middle stage ends the run, up to 34% under their
        price.)"""
        mids = [k for k in of_t if self.is_mid[k]]
        if not firsts or not mids:
            return
        some_mid = var(f"tmid{t}", lowBound=0, upBound=1)
        for q in mids:
            self.prob += some_mid >= self.u[q]
        for g in firsts:
            self.prob += g <= 1 - some_mid + lin(last)

    def _runs(self, var, lin, Z, order: list[int]) -> None:
        """Vendor runs: which are used, the first/last stage in the first/last used run, the bridge stage
        ending each run that has a used run after it, and memory run by run."""
        c, prob, ks, M = self.c, self.prob, self.ks, self.M
        big = M + self.n
        of = {v: [k for k in ks if c.vendor[k] == v] for v in order}
        used = {v: var(f"used{v}", cat=pulp.LpBinary) for v in order}
        for k in ks:
            prob += used[int(c.vendor[k])] >= self.u[k]
        self.beta: dict[int, object] = {}
        for r, v in enumerate(order):
            prob += used[v] <= lin([(self.x[q], 1.0) for q in of[v]])
            before, after = order[:r], order[r + 1:]
            for w in before:  # the first stage sits in the first used run
                prob += lin([(self.x[k], 1.0) for k in of[v] if self.is_first[k]]) + used[w] <= 1
            for w in after:  # ... and the last stage in the last
                prob += lin([(self.x[k], 1.0) for k in of[v] if self.is_last[k] or self.is_whole[k]]) + used[w] <= 1
            # stages after this run's: the later runs' middles and the last stage (always at the end)
            later_n = var(f"later{v}", lowBound=0)
            prob += later_n == lin([(self.x[k], 1.0) for w in after for k in of[w] if self.is_mid[k]])
            later = later_n + 1
            if after:
                beta = {k: var(f"beta{k}", cat=pulp.LpBinary) for k in of[v]
                        if not (self.is_last[k] or self.is_whole[k])}
                total = lin([(b, 1.0) for b in beta.values()])
                for w in after:  # one bridge exactly when this run and a later one are used
                    prob += total >= used[v] + used[w] - 1
                prob += total <= used[v]
                prob += total <= lin([(used[w], 1.0) for w in after])
                mids = [(self.x[q], 1.0) for q in of[v] if self.is_mid[q]]
                run_mids = None
                if mids:
                    run_mids = var(f"middles{v}", lowBound=0)
                    prob += run_mids == lin(mids)
                for k, b in beta.items():
                    prob += b <= self.x[k]
                    prob += Z >= float(c.bridged_pace_s[k]) * b
                    if self.is_first[k]:  # the first stage ends its run only when it is all of it
                        if run_mids is not None:
                            prob += run_mids <= big * (1 - b)
                    elif c.in_flight[k] < M:
                        prob += later + 1 <= float(c.in_flight[k]) + big * (1 - b)
                prob.objective += lin([(b, float(c.bridge_s[k])) for k, b in beta.items()])
                self.beta.update(beta)
            # this run's middles fitting <= cap in flight, cumulated over the distinct caps (linear size)
            tail = [k for k in of[v] if self.is_mid[k] and c.in_flight[k] < M]
            upto, prev = {}, None
            for cap in sorted({int(c.in_flight[k]) for k in tail}):
                cum = var(f"cum{v}_{cap}", lowBound=0)
                prob += cum == (prev if prev is not None else 0) + lin(
                    [(self.x[k], 1.0) for k in tail if c.in_flight[k] == cap])
                upto[cap], prev = cum, cum
            for k in tail:
                cap = int(c.in_flight[k])
                prob += upto[cap] + later <= float(cap) + big * (1 - self.u[k])

    def solve_counts(self, solver: str, time_limit_s: float, cutoff: Optional[float]):
        """(counts per candidate or None, status, dual bound)."""
        out = self.solve(solver, time_limit_s, cutoff)
        if not out.solved:
            return None, out.status, out.bound
        counts = {k: int(round(self.x[k].value() or 0)) for k in self.ks}
        self.value = float(pulp.value(self.prob.objective))
        self.bridged = [k for k, b in self.beta.items() if (b.value() or 0) > 0.5]
        return {k: v for k, v in counts.items() if v > 0}, out.status, out.bound


def order_chain(c: Candidates, chosen: dict[int, int], bridged: Sequence[int], vendor_order: Sequence[int],
                n: int, counts: Sequence[int], M: int) -> Optional[tuple[Candidates, float]]:
    """The chosen shapes as a pipeline laid over the layers in order, priced exactly (``objective_of``).

    The MILP's order first: the first stage, then one run per vendor in ``vendor_order``, each run's
    stages by in-flight capacity (largest first, as 1F1B memory needs) and its ``bridged`` stage last,
    then the last stage. Should that break memory, the runs by capacity alone, then all stages by capacity;
    the cheapest feasible order wins."""
    first = [k for k in chosen if c.first_unit[k] == 0]
    last = [k for k in chosen if c.end_unit[k] == n and c.first_unit[k] > 0]
    mids = [k for k, cnt in chosen.items() for _ in range(cnt) if c.first_unit[k] > 0 and c.end_unit[k] < n]
    ends_run = [k for k in bridged if c.first_unit[k] > 0]
    rest = list(mids)
    for k in ends_run:
        rest.remove(k)
    by_cap = lambda ks: sorted(ks, key=lambda k: -c.in_flight[k])  # noqa: E731
    orders = [[k for v in vendor_order for k in by_cap([q for q in rest if c.vendor[q] == v])
               + [q for q in ends_run if c.vendor[q] == v]],
              [k for v in vendor_order for k in by_cap([q for q in mids if c.vendor[q] == v])],
              by_cap(mids)]
    orders += _type_grouped(c, rest, ends_run, vendor_order)
    best = None
    for order in orders:
        seq = first + order + last
        rows = {f: getattr(c, f)[seq].copy() for f in FIELDS}
        at = 0
        for pos, k in enumerate(seq):
            size = int(c.end_unit[k] - c.first_unit[k])
            rows["first_unit"][pos], rows["end_unit"][pos] = at, at + size
            at += size
        if at != n:
            return None
        chain = Candidates(**rows)
        idx = list(range(len(seq)))
        if not chain_is_feasible(chain, idx, counts, M):
            continue
        obj = objective_of(chain, idx, M)
        if best is None or obj < best[1]:
            best = (chain, obj)
    return best


def _type_grouped(c: Candidates, rest: list[int], ends_run: list[int], vendor_order: Sequence[int],
                  most: int = 64) -> list[list[int]]:
    """Orders of the middle stages with each vendor run's stages grouped by device type (a boundary between
    types crosses hosts: ``Candidates.hop_s``), each group by capacity, or by capacity but for the stage whose
    pace the crossing raises least, last (the one the shape MILP lets pay it: ordered by capacity alone, a
    narrower stage paid it and 8 A100 + 16 V100 on 25 Gbit/s priced its MILP's chains up to 38% above their
    value): every order of the groups within each run, up to ``most`` orders in all."""
    per_run = []
    for v in vendor_order:
        mine = [q for q in rest if c.vendor[q] == v]
        groups = [sorted((q for q in mine if c.type_idx[q] == t), key=lambda q: -c.in_flight[q])
                  for t in sorted({int(c.type_idx[q]) for q in mine})]
        hopped = c.hopped_pace_s  # a property over every candidate: computed once, not per stage
        ways = []
        for g in groups:
            moved = _payer_last(c, g, hopped)
            ways.append([g] if moved == g else [g, moved])
        per_run.append([[q for g in perm for q in g] + [q for q in ends_run if c.vendor[q] == v]
                        for order in itertools.permutations(range(len(groups)))
                        for perm in itertools.product(*(ways[i] for i in order))])
    out = []
    for runs in itertools.product(*per_run):
        if len(out) >= most:
            break
        out.append([q for run in runs for q in run])
    return out


def _payer_last(c: Candidates, group: list[int], hopped: np.ndarray) -> list[int]:
    """``group`` with the stage whose pace its next stage on other hosts raises least (``hopped``:
    ``Candidates.hopped_pace_s``) moved last."""
    at = min(range(len(group)), key=lambda i: (float(hopped[group[i]]), float(c.hop_s[group[i]]), -i))
    return group[:at] + group[at + 1:] + [group[at]]


def greedy_shapes(c: Candidates, n: int, counts: Sequence[int], M: int, vendor_order: Sequence[int], cap: float
                  ) -> Optional[tuple[dict[int, int], list[int]]]:
    """A plan of shapes costing <= ``cap`` built from the last stage backwards, one run per vendor in
    ``vendor_order``: at each position the shape holding the most blocks per device among those that fit the
    devices left and 1F1B's in-flight count there (min(position from the end, M)); a run followed by a later
    one ends with a stage that pays the bridge; the first stage takes the blocks left as soon as one can.
    (counts per shape, bridged shapes) or None. Why: the search's fallback when its time limit ends before
    any capped MILP found a plan (on the 768-device cluster such MILPs take 1-4 s to find their first)."""
    L = n - 2
    first, end = c.first_unit, c.end_unit
    is_first, is_last = (first == 0) & (end < n), (end == n) & (first > 0)
    is_mid = (first > 0) & (end < n)
    blocks = shape_blocks(c, n)
    devices, use = c.devices, c.uses_matrix(len(counts))
    left = np.asarray(counts, dtype=np.int64).copy()
    chosen: dict[int, int] = {}
    bridged: list[int] = []

    def pick(mask: np.ndarray, p: int, bridge: bool) -> Optional[int]:
        pace = c.bridged_pace_s if bridge else c.pace_s
        ok = mask & (pace <= cap * (1 + 1e-9)) & (c.in_flight >= min(p, M)) & (use <= left).all(axis=1)
        idx = np.flatnonzero(ok)
        if not len(idx):
            return None
        return int(idx[np.lexsort((devices[idx], -blocks[idx] / devices[idx]))[0]])

    def take(k: int, bridge: bool) -> None:
        chosen[k] = chosen.get(k, 0) + 1
        left[:] -= use[k]
        if bridge:
            bridged.append(k)

    runs = [int(v) for v in vendor_order if (c.vendor == v).any()]
    if not runs:
        return None
    k = pick(is_last & (c.vendor == runs[-1]), 1, False)
    if k is None:
        return None
    take(k, False)
    rest, p = L - int(blocks[k]), 2
    for r in range(len(runs) - 1, -1, -1):  # runs from the last; earlier ones may stay empty
        mine = c.vendor == runs[r]
        bridge = r < len(runs) - 1  # the last run always holds the last stage
        while True:
            k = pick(is_first & mine & (blocks == rest), p, bridge)
            if k is not None:
                take(k, bridge)
                return chosen, bridged
            k = pick(is_mid & mine & (blocks <= rest), p, bridge) if rest > 0 else None
            if k is None:
                break
            take(k, bridge)
            bridge, rest, p = False, rest - int(blocks[k]), p + 1
    return None


def _keep(c: Candidates, mask: np.ndarray) -> Candidates:
    idx = np.flatnonzero(mask)
    return Candidates(*(getattr(c, f)[idx] for f in FIELDS))


class ShapeSearch:
    """The search over micro-batch sizes with the shape MILP: the same contract as ``planner._Search``
    (``best``, ``pool`` of the best chain per size, ``stats``), chains at layer granularity.

    Per size b (in order of the bound M * T_lb, T_lb from ``blocks_lower_bound``): until a first plan exists,
    pass 1 caps the bottleneck a little above T_lb (Z <= T: a small MILP, usually solved to optimality in well
    under a second) and raises the cap until a plan appears; a solved capped MILP proves that no plan with
    Z <= T beats its value, and none with Z > T beats M * T. Once one exists, each size is searched by slices
    of Z up to incumbent / M (``_slices``), in pass 1 briefly, then in pass 2 best first (the size with the
    lowest bound next). Every MILP runs once per order of the vendors, so the bound holds over plans that visit
    each vendor in one run of stages.
    """

    CAPS = (1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 2.0)
    DUAL_SHARE = 0.1  # of the time limit, for ``DualBound`` after pass 1
    SMALL = 2000  # candidates with a pace within CAPS[-1] x the size's bound

    def __init__(self, cm: CostModel, global_batch: int, opts, progress, types: list[str], counts: list[int],
                 sizes: list[int]):
        self._Solution, self._time = Solution, time
        self.cm, self.G, self.opts, self.progress = cm, global_batch, opts, progress
        self.types, self.counts, self.sizes = types, counts, sizes
        self.n = cm.model.num_planner_layers
        self.sample_s = [cm.sample_s(t) for t in types]
        self.t0 = time.perf_counter()
        self.best = None
        self.pool: dict[tuple, object] = {}
        self.bounds: dict[int, float] = {}
        self.jobs = []
        for b in sizes:
            M = global_batch // b
            c = shape_candidates(cm, b, M, types, dict(zip(types, counts)), opts.allow_recompute,
                                 opts.max_tensor_parallel, mixed=opts.mixed_types, schedule=opts.schedule,
                                 zero1=opts.zero1_stages, overlap=opts.network == "overlap")
            t_lb = blocks_lower_bound(c, self.n, counts, M, self.sample_s) if len(c) else math.inf
            lb = (M - 1) * t_lb + blocks_sum_lower_bound(c, self.n) if math.isfinite(t_lb) else math.inf
            self.jobs.append(Job(lb, b, M, c, t_lb))
            self.bounds[b] = lb
        self.jobs.sort(key=lambda j: j.lower_bound_s)
        self.candidates = sum(len(j.cand) for j in self.jobs)
        self.slices: dict[int, tuple] = {}  # per size, the slices of Z still open (``_slices``)
        self.milps = 0
        self.timeouts = 0  # MILPs stopped by their time limit (none: every size was searched to the end)

    def left(self) -> float:
        # HiGHS may run past its time limit (it checks the clock between phases) and PuLP hands the model
        # over before the clock starts; the simulator then replays the best plans: 25% of the limit is kept
        # for that, so the search ends in time.
        return 0.75 * self.opts.time_limit_s - (self._time.perf_counter() - self.t0)

    def _solve(self, b: int, M: int, c: Candidates, t_lb: float, cap: float, seconds: float,
               z_lower: Optional[float] = None, shape_top: Optional[float] = None,
               cutoff: Optional[float] = None) -> float:
        """Every vendor order at bottleneck cap ``cap``; offers the chains found; returns the bound this proves
        for size b (the best value over Z <= cap, or M * cap beyond it). With ``z_lower`` (a slice of pass 2):
        the bound over z_lower <= Z <= cap alone, the shapes pacing <= ``shape_top`` (default ``cap``). Only
        chains below ``cutoff`` are looked for (default: the incumbent)."""
        sub = _keep(c, c.pace_s <= (cap if shape_top is None else shape_top) * (1 + 1e-9))
        vendors = sorted({int(v) for v in sub.vendor})
        if cutoff is None:
            cutoff = self.best.objective if self.best is not None else None
        bound = math.inf
        perms = list(itertools.permutations(vendors))
        for n_perm, perm in enumerate(perms):
            if self.left() <= 0.1:
                return min(bound, self.bounds[b])
            # the orders share this call's seconds (what one leaves, the next gets); until a first plan exists,
            # each may use all that is left of them: a cut-short MILP finds nothing
            share = seconds / (len(perms) - n_perm) if self.best is not None else seconds
            if min(share, self.left()) < 0.2:  # too little to solve anything: this order stays unproven
                self.timeouts += 1
                bound = min(bound, self.bounds[b])
                continue
            milp = ShapeMilp(sub, self.n, self.counts, M, perm, t_lb if z_lower is None else z_lower,
                             cap if math.isfinite(cap) else None)
            self.milps += 1
            started = self._time.perf_counter()
            chosen, status, milp_bound = milp.solve_counts(self.opts.solver, min(share, self.left()), cutoff)
            seconds -= self._time.perf_counter() - started
            self.timeouts += status == "timeout"
            bound = min(bound, milp_bound)  # infeasible: inf, or the cutoff when nothing beats it
            if chosen:
                res = order_chain(sub, chosen, milp.bridged, perm, self.n, self.counts, M)
                if res is not None:
                    sol, obj = self._chain(b, M, res, milp_bound, status), res[1]
                    if (b,) not in self.pool or obj < self.pool[(b,)].objective:
                        self.pool[(b,)] = sol
                    if self.best is None or obj < self.best.objective:
                        self.best = sol
                    cutoff = obj if cutoff is None else min(cutoff, obj)  # the next order looks below it
        return bound if z_lower is not None else min(bound, M * cap)

    def _chain(self, b: int, M: int, res: tuple[Candidates, float], bound: float, status: str):
        """An ordered chain (``order_chain``'s result) as the planner's Solution, at layer granularity."""
        chain, obj = res
        sol = self._Solution(b, M, list(range(len(chain))), obj, bound, status, chain)
        sol.units = [(l, l + 1) for l in range(self.n)]
        return sol

    def _greedy(self, j: Job, cap: float) -> None:
        """The best greedy chain (``greedy_shapes``) of size j at bottleneck ``cap`` over the vendor orders,
        offered as the incumbent."""
        for perm in itertools.permutations(sorted({int(v) for v in j.cand.vendor})):
            got = greedy_shapes(j.cand, self.n, self.counts, j.M, perm, cap)
            res = order_chain(j.cand, *got, perm, self.n, self.counts, j.M) if got else None
            if res is not None and (self.best is None or res[1] < self.best.objective):
                self.best = self._chain(j.b, j.M, res, 0.0, "feasible")

    def seed(self, jobs: list[Job]) -> None:
        """A greedy incumbent before any MILP: the first size (in ``jobs``' order) and the lowest cap that give
        one. Why: until a plan exists a capped MILP must find one by itself, which on 768 devices takes 1-4 s
        and, on a slower machine, past a 10-s limit, leaving the fallback's plan (18 samples/s where the MILPs
        find 29); with it, every MILP only has to beat it (~0.1 s). It takes a tenth of the time limit at most
        (where no greedy plan exists, e.g. memory-bound sizes, it would try every size and cap). Only searches
        over several device types are seeded: one type's capped MILPs found their first plans in time on every
        case, and seeded, `plan`'s single-type comparisons on 768 devices took other paths to plans whose replays
        took 4 s instead of 0.5 (the command 12-13 s instead of 8.5)."""
        until = self._time.perf_counter() + self.DUAL_SHARE * self.opts.time_limit_s
        for j in jobs:
            for f in self.CAPS if math.isfinite(j.t_lb) else ():
                if self.best is not None or self._time.perf_counter() >= until:
                    return
                self._greedy(j, j.t_lb * f)

    def fallback(self) -> None:
        """When the time limit ended the MILPs before any plan: the best greedy plan (``greedy_shapes``) over the
        sizes and a few caps, so a short limit gives a plan rather than an error (its gap says how good). Sizes in
        order of their bound; once it has a plan, it stops at the time limit."""
        for j in self.jobs:
            if not math.isfinite(j.t_lb):
                continue
            for f in self.CAPS:
                if self.best is not None and self._time.perf_counter() - self.t0 >= self.opts.time_limit_s:
                    break
                self._greedy(j, j.t_lb * f)
        if self.best is not None:  # the one plan the simulator replays
            self.pool = {(self.best.b,): self.best}

    def ran_out(self) -> bool:
        """Whether the time limit cut the search short (a MILP stopped by it, or too little time left to start one)."""
        return self.timeouts > 0 or self.left() <= 0.2

    def beaten(self, bound: float) -> bool:
        return self.best is not None and bound >= self.best.objective * (1 - 1e-9)

    def settled(self, bound: float) -> bool:
        """Within HiGHS's own relative MIP gap of the incumbent: what the search reports optimal, so no more
        time goes to it."""
        return self.best is not None and bound >= self.best.objective * (1 - OPTIMAL_GAP)

    def run(self) -> None:
        quick = max(self.opts.time_limit_s / (2 * max(1, len(self.jobs))), 2.0)
        # pass 1: sizes with few candidates within 2x their bound first (HiGHS may take seconds to find a first
        # plan in a large MILP), each group in order of its bound
        small = lambda j: int((j.cand.pace_s <= j.t_lb * self.CAPS[-1]).sum()) <= self.SMALL  # noqa: E731
        per_size = self.DUAL_SHARE * self.opts.time_limit_s / max(1, len(self.jobs))
        order = sorted(self.jobs, key=lambda j: (not small(j), j.lower_bound_s))
        if len(set(self.types)) > 1:
            self.seed(order)
        for j in order:
            b, M, c, t_lb = j.b, j.M, j.cand, j.t_lb
            self.dual_bound(b, M, c, t_lb, min(per_size, self.left()))  # may spare this size its MILPs
            if self.best is not None and math.isfinite(t_lb) and not self.settled(self.bounds[b]):
                self.bounds[b] = max(self.bounds[b], self._slices(b, M, c, t_lb, min(quick, self.left())))
                self._report(b)
                continue
            for f in self.CAPS:
                if not math.isfinite(t_lb) or self.beaten(self.bounds[b]) or self.left() <= 0.1:
                    break
                cap = t_lb * f if self.best is None else min(t_lb * f, self.best.objective / M)
                # until a first plan exists, a capped MILP may take half the time left: on the 768-device
                # benchmark the first feasible cap's MILP needs 2-3 s, and a cut-short one finds nothing
                seconds = quick if self.best is not None else max(quick, self.left() / 2)
                self.bounds[b] = max(self.bounds[b], self._solve(b, M, c, t_lb, cap, seconds))
                if (b,) in self.pool or cap * M >= (self.best.objective if self.best else math.inf):
                    break
            self._report(b)
        if self.best is None:  # pass 2 without an incumbent: nothing to prove against, each size's whole range
            for j in self.jobs:
                b, M, c, t_lb = j.b, j.M, j.cand, j.t_lb
                if math.isfinite(t_lb) and self.left() > 0.2:
                    todo = sum(1 for j in self.jobs if not self.beaten(self.bounds[j.b]))
                    seconds = self.left() / max(1, todo)
                    self.bounds[b] = max(self.bounds[b], self._solve(b, M, c, t_lb, math.inf, seconds))
                    self._report(b)
        while self.best is not None and self.left() > 0.2:  # pass 2: the size with the lowest bound next
            todo = [j for j in self.jobs if math.isfinite(j.t_lb) and not self.settled(self.bounds[j.b])
                    and (j.b not in self.slices or self._open(j.b))]
            if not todo:
                break
            j = min(todo, key=lambda j: self.bounds[j.b])
            b, M, c, t_lb = j.b, j.M, j.cand, j.t_lb
            seconds = max(self.left() / len(todo), min(2.0, self.left()))
            self.bounds[b] = max(self.bounds[b], self._slices(b, M, c, t_lb, seconds))
            self._report(b)
        self.runners_up()
        if self.best is None and self.ran_out():
            self.fallback()
        if self.best is not None and self.pool.get((self.best.b,)) is not self.best:
            # the greedy seed, where no MILP beat it: the simulator replays it too (the pool holds the MILPs'
            # chains, the best of each size, which the simulator chooses among)
            self.pool[(self.best.b,)] = self.best
        # the gap the plan reports: each size still open, against the final incumbent, out of the time kept for
        # the replays (up to DUAL_SHARE of the limit, never past 0.85 of it)
        end = self._time.perf_counter() + min(self.DUAL_SHARE * self.opts.time_limit_s,
                                              self.left() + 0.1 * self.opts.time_limit_s)
        todo = [j for j in self.jobs if not self.settled(self.bounds[j.b])]
        for k, j in enumerate(todo):
            self.dual_bound(j.b, j.M, j.cand, j.t_lb, (end - self._time.perf_counter()) / (len(todo) - k))

    def runners_up(self) -> None:
        """With the time passes 1 and 2 leave: each other size's own best chain, where the chain the pool holds for
        it is within ``REPLAY_WITHIN`` of the incumbent (the simulator replays the chains the closed form puts
        there). Why: the MILPs prove the incumbent, so they look only below it, and the chain the pool holds for
        another size is the best one met on the way, not that size's best; the simulator chooses among the sizes'
        chains (the closed form ranks, the replay decides). 64 A100 + 64 V100 on 8-GPU hosts, 1F1B: micro-batch
        32's chain in the pool was 1.8% above its own best, which replays 3.0% faster than the incumbent.
        (``planner._Search`` looks within the window in its every MILP.)"""
        if self.best is None:
            return
        window = self.best.objective * REPLAY_WITHIN
        todo = sorted((j for j in self.jobs if (j.b,) in self.pool and self.pool[(j.b,)] is not self.best
                       and self.pool[(j.b,)].objective <= window), key=lambda j: self.pool[(j.b,)].objective)
        for k, j in enumerate(todo):
            if self.left() <= 0.2:
                break
            held = self.pool[(j.b,)].objective
            self._solve(j.b, j.M, j.cand, j.t_lb, held / j.M, self.left() / (len(todo) - k), cutoff=held)

    def _open(self, b: int) -> bool:
        """Whether size b has a slice left to work on: one not yet within the gap (the heap's least is first).
        (Asking only for a non-empty heap spun pass 2 until the time limit when every slice left was settled and
        a single-pace slice, which is never split, held the size's bound down.)"""
        heap = self.slices[b][1]
        return bool(heap) and not self.settled(heap[0][0])

    def _slices(self, b: int, M: int, c: Candidates, t_lb: float, seconds: float) -> float:
        """Size b's bound against the incumbent, proven slice by slice of the bottleneck Z, within ``seconds``
        (pass 1 once an incumbent exists, then pass 2's turns; the open slices are kept between calls).

        Why: one MILP over t_lb <= Z <= incumbent / M links Z to the shapes by big-M rows whose relaxation is weak;
        at HETHUB's scale it often ran out of time with its bound 2-5% under the incumbent. Over a narrow slice
        of Z the relaxation is nearly tight and the incumbent's cutoff prunes at once (on the 768-device
        benchmark a slice takes ~1 s where the whole range took up to 30). Slices are cut at the shapes' paces:
        slice [i0, i1] holds the plans with paces[i0] <= Z < paces[i1 + 1], which use only shapes pacing <= paces[i1]
        (``DualBound``'s region over the same paces bounds exactly them). The first slices end at pass 1's caps
        (``CAPS`` x the knapsack bound). Lowest bound first, a slice gets a MILP (all the seconds left); one that
        runs out of time is halved. Plans with Z above the incumbent / M cannot beat it. Returns the least bound
        over the slices left open (the incumbent when none is)."""
        end = self._time.perf_counter() + seconds
        if b not in self.slices:  # the first call for this size
            dual = DualBound(c, self.n, self.counts, M, t_lb, self.sample_s)
            top = self.best.objective / M
            hi = int(np.searchsorted(dual.paces, top, side="right")) - 1
            if hi < 0:
                return self.best.objective
            # good plans sit near the bound, and a wide slice from the bound to a first incumbent far above it
            # is a hard MILP: the first slices end at the caps
            cuts = sorted({int(np.searchsorted(dual.paces, t_lb * f, side="right")) for f in self.CAPS} | {hi + 1})
            heap, i0 = [], 0
            for i1 in (i - 1 for i in cuts if 0 < i <= hi + 1):
                if i1 >= i0:
                    v, lam = dual.region((i0, i1, 0, len(dual.allreduces) - 1), dual.lam0, step=1.0)
                    heap.append((v, i0, i1, lam))
                    i0 = i1 + 1
            heapq.heapify(heap)
            self.slices[b] = (dual, heap, [], top)
        dual, heap, stuck, top = self.slices[b]  # stuck: slices closed to the MILP's gap or single paces left open
        top_j = len(dual.allreduces) - 1
        paces = dual.paces
        z_end = lambda i: float(paces[i + 1]) if i + 1 < len(paces) and paces[i + 1] <= top else top  # noqa: E731
        while heap and not self.settled(heap[0][0]):
            left = min(end - self._time.perf_counter(), self.left())
            if left < 0.2:
                break
            v, i0, i1, lam = heapq.heappop(heap)
            v = max(v, self._solve(b, M, c, t_lb, z_end(i1), left, z_lower=float(paces[i0]),
                                   shape_top=float(paces[i1])))
            if self.beaten(v):  # no plan of the slice beats the incumbent (or its best is the incumbent now)
                continue
            if i0 == i1 or self.settled(v):  # a single pace left open, or closed to the MILP's own gap
                stuck.append(v)
                continue
            mid = (i0 + i1) // 2  # out of time: halve it
            for h0, h1 in ((i0, mid), (mid + 1, i1)):
                hv, h_lam = dual.region((h0, h1, 0, top_j), lam, step=0.25)
                heapq.heappush(heap, (max(v, hv), h0, h1, h_lam))
        return float(min([h[0] for h in heap] + stuck + [self.best.objective]))

    def dual_bound(self, b: int, M: int, c: Candidates, t_lb: float, budget_s: float) -> None:
        """Raise size b's bound by ``DualBound`` against the incumbent (none yet: nothing to prove against)."""
        if self.best is None or budget_s <= 0 or not math.isfinite(t_lb) or self.settled(self.bounds[b]):
            return
        dual = DualBound(c, self.n, self.counts, M, t_lb, self.sample_s).bound(self.best.objective, budget_s)
        self.bounds[b] = max(self.bounds[b], dual)

    def _report(self, b: int) -> None:
        if self.progress is not None:
            self.progress({"micro_batch_size": b, "done": sum(1 for j in self.jobs if self.beaten(self.bounds[j.b])),
                           "total": len(self.jobs),
                           "incumbent_s": self.best.objective if self.best is not None else math.inf,
                           "bound_s": min(self.bounds.values()),
                           "elapsed_s": self._time.perf_counter() - self.t0})

    def stats(self) -> dict:
        gap = max(0.0, (self.best.objective - min(self.bounds.values())) / self.best.objective)
        return {"seconds": self._time.perf_counter() - self.t0, "micro_batch_sizes": self.sizes,
                "candidates": self.candidates, "units": self.n, "milp_variables": self.candidates,
                "gap": gap, "status": "optimal" if gap <= OPTIMAL_GAP else "feasible",
                "alternatives": sorted(self.pool.values(), key=lambda s: s.objective)}
