"""Compute orders of the chunked schedules (``interleaved-1f1b``, ``zb-v``): per device group, which forward,
backward and weight pass of which chunk and micro-batch runs next.

A group of a chunked plan holds several chunks (``Plan.pipeline``); an order is a list of ``(kind, mb, chunk)``
with ``kind`` in F, B, W and ``chunk`` the chunk's pipeline position. ``schedule.build_schedule`` lowers these
orders into action lists (receives posted ahead, sends after the pass that makes them), the same way it lowers
1F1B's; the simulator replays them and ``ordering.check_order`` proves them free of NCCL deadlocks.

Both orders work for every micro-batch count M >= 1 (Megatron's interleaving needs M divisible by the pipeline
size, ZB-V's published schedule M >= 2p), and both are static: a group's order does not depend on timing, so the
runtime, the simulator and the deadlock check see the same lists.
"""
from __future__ import annotations

import heapq
from typing import Optional, Sequence

import numpy as np

from .groups import SEND_WINDOW
from .records import Plan, chunk_group
from .schedule_kinds import V_SHAPE, kind as schedule_kind

Order = list[tuple[str, int, int]]  # (F|B|W, micro-batch, chunk position)
TIME_STEPS = 100  # zb-v's list scheduler counts a pass's time in steps of 1/TIME_STEPS of the longest pass
# ``v_sizes`` keeps a table of (L+1)^2 cells per group: past this many in all, zb-v is cut by count and polished
# (the 768-device plan, 29 groups of a 162-layer model: 0.8M cells, 0.25 s; a 10,000-block model would need GBs)
EXACT_V_CELLS = 5_000_000


def interleaved_sequences(p: int, v: int, g: int, M: int) -> tuple[Order, Order]:
    """Group g's forwards and backwards in interleaved order: micro-batches in rounds of p (the last round shorter
    when p does not divide M), a round's micro-batches through chunk 0, 1, ..., v-1 (chunk c*p + g is the group's
    c-th), their backwards through the chunks in reverse."""
    rounds = [range(r0, min(r0 + p, M)) for r0 in range(0, M, p)]
    fwd = [("F", mb, c * p + g) for rnd in rounds for c in range(v) for mb in rnd]
    bwd = [("B", mb, c * p + g) for rnd in rounds for c in reversed(range(v)) for mb in rnd]
    return fwd, bwd


def interleaved_orders(p: int, v: int, M: int, train: bool = True) -> list[Order]:
    """Interleaved 1F1B for p groups of v chunks, any M (the order depends on p, v and M only).

    Megatron's order (``_megatron_order``) asks M % p == 0; where p does not divide M, its fixed alternation of one
    forward and one backward deadlocks with a short last round (156 of the cases up to p = 7, v = 4, M = 39). The
    generalisation: plan ceil(M/p)*p micro-batches and drop the passes of those past M. That cannot deadlock: the
    padded order's dependencies are acyclic, and dropping a pass only joins its neighbours in a group's order, an
    edge that was a path before (a micro-batch's passes depend on its own passes only)."""
    if not train:
        return [interleaved_sequences(p, v, g, M)[0] for g in range(p)]
    padded = M if v == 1 else -(-M // p) * p  # 1F1B (v = 1) needs no padding
    return [[x for x in _megatron_order(p, v, g, padded) if x[1] < M] for g in range(p)]


def zbv_orders(layers: list[int], p: int, M: int, train: bool = True,
               pass_ms: Optional[Sequence[Sequence[float]]] = None) -> list[Order]:
    """ZB-V for p groups, group g holding chunks g and 2p-1-g (``layers``: each chunk's layer count, pipeline
    order), found by a list scheduler on the passes' times: ``pass_ms`` (per chunk its forward, input-gradient and
    weight-gradient pass on its group, ``Plan.chunk_pass_ms``), else unit costs (a pass of a chunk takes its layer
    count; chunk 0's backward, which has no input gradient to split off, takes two). Unit costs are right only
    where every group runs a layer at one speed: on a V100 group beside A100s they had the A100s wait for passes
    the order assumed were short (8 A100 + 8 V100, gpt-1.3b: 1.90 s/iteration against 1.58 s ordered by time).

    Each group, when free, runs: a ready backward (input gradients: they unblock the group upstream), else a ready
    forward of its second-leg chunk, else one of its first-leg chunk if it leaves room for 2p chunk-micro-batches of
    activations counting the second legs still to come (2p chunks of 1/(2p) of the layers: 1F1B's first-stage
    memory, the V's promise; second-leg forwards are never held back, as a group full of first-leg activations
    only gets out through them), else its oldest pending weight pass (W fills what would be bubble),
    else it waits for the next pass anywhere to end. Forwards and backwards of a chunk go in micro-batch order, and
    none runs more than ``SEND_WINDOW`` micro-batches ahead of the chunk its output (its input gradient) goes to on
    another group: the runtime holds at most that many unfinished sends per peer, and an order that ran further
    ahead hung there (4 groups, 8 micro-batches; ``ordering.check_order`` proves the orders finish).
    The resulting order is fixed data: it finished under unit costs, so its dependencies are acyclic and it finishes
    under any costs (a deadlock would be a cycle)."""
    return _ZeroBubbleV(layers, p, M, train, pass_ms).run()


def _megatron_order(p: int, v: int, g: int, M: int) -> Order:
    """Megatron's static interleaved order (p divides M, or v = 1: then 1F1B): (v-1)*p + 2*(p-g-1) warm-up forwards
    (1F1B's p-g-1 at v = 1), then one forward and one backward in turn, then the drain."""
    fwd, bwd = interleaved_sequences(p, v, g, M)
    total = M * v
    warm = min(total, p - g - 1 if v == 1 else (v - 1) * p + 2 * (p - g - 1))
    out: Order = fwd[:warm]
    for i in range(total - warm):
        out += [fwd[warm + i], bwd[i]]
    return out + bwd[total - warm:]


class _ListScheduler:
    """A list scheduler on unit costs over p groups: per group when it is free and the passes' end times; a
    subclass's ``pick`` chooses a group's next pass and ``record`` books it. The order each group ran is the
    schedule."""

    def __init__(self, layers: list[int], p: int, M: int, V: int, need: int):
        self.layers, self.p, self.M, self.V, self.need = layers, p, M, V, need
        self.finish: dict[tuple[str, int, int], float] = {}  # (kind, mb, chunk) -> when it ends
        self.free_at = [0.0] * p
        self.orders: list[Order] = [[] for _ in range(p)]
        self.forced = False  # one pass past a group's cap is let through (every group waited)

    def done(self, key, now: float) -> bool:
        return key in self.finish and self.finish[key] <= now

    def fwd_ready(self, mb: int, k: int, now: float) -> bool:
        return k == 0 or self.done(("F", mb, k - 1), now)

    def bwd_ready(self, mb: int, k: int, now: float) -> bool:
        return self.done(("F", mb, k), now) and (k == self.V - 1 or self.done(("B", mb, k + 1), now))

    def duration(self, kind: str, k: int) -> float:
        return float(self.layers[k] * (2 if kind == "B" and k == 0 else 1))

    def run(self) -> list[Order]:
        events: list[float] = []
        t, scheduled = 0.0, 0
        while scheduled < self.need:
            progressed = False
            for g in range(self.p):
                choice = self.pick(g, t) if self.free_at[g] <= t else None
                if choice is not None:
                    kind, mb, k = choice
                    end = t + self.duration(kind, k)
                    self.finish[(kind, mb, k)] = self.free_at[g] = end
                    self.orders[g].append(choice)
                    self.record(g, kind, mb, k)
                    heapq.heappush(events, end)
                    scheduled += 1
                    progressed = True
                    self.forced = False
            if not progressed:
                while events and events[0] <= t:
                    heapq.heappop(events)
                if events:
                    t = heapq.heappop(events)
                elif not self.forced:
                    self.forced = True
                else:
                    raise RuntimeError(f"{type(self).__name__}: the list scheduler stalled at p={self.p}, "
                                       f"M={self.M} (a bug)")
        return self.orders


class _ZeroBubbleV(_ListScheduler):
    """``zbv_orders``' state: per chunk the next forward and backward micro-batch, per group its pending weight
    passes and held activations."""

    def __init__(self, layers: list[int], p: int, M: int, train: bool,
                 pass_ms: Optional[Sequence[Sequence[float]]] = None):
        super().__init__(layers, p, M, 2 * p, 3 * M * 2 * p - M if train else M * 2 * p)  # chunk 0 has no W
        self.train, self.cap, self.pass_ms = train, 2 * p, pass_ms
        self.step_ms = max(max(t) for t in pass_ms) / TIME_STEPS if pass_ms else 1.0
        self.groups = [(g, 2 * p - 1 - g) for g in range(p)]
        self.nxt_f = {k: 0 for k in range(self.V)}
        self.nxt_b = {k: 0 for k in range(self.V)}
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.held = [0] * p

    def duration(self, kind: str, k: int) -> float:
        """Unit costs, or the chunk's pass in steps of 1/TIME_STEPS of the longest pass: passes within a step of
        each other tie, as equal chunks do under unit costs, and the order does not hinge on sub-percent
        differences between them. (768 devices, 15 groups, full replays: 53.9 s/iteration in steps of 1/100,
        54.0 s on exact times, 55.6 s in steps of 1/20, 81.5 s on unit costs.)"""
        if self.pass_ms is None:
            return super().duration(kind, k)
        fwd, bwd, wgt = self.pass_ms[k]
        ms = fwd if kind == "F" else wgt if kind == "W" else bwd + (wgt if k == 0 else 0.0)
        return float(max(1, round(ms / self.step_ms)))

    def pick(self, g: int, now: float):
        M, (down, up) = self.M, self.groups[g]
        if self.train:
            for k in (up, down):
                mb = self.nxt_b[k]
                if mb < M and self.bwd_ready(mb, k, now) and self.returned(mb, k):
                    return "B", mb, k
        # a first-leg forward reserves room for its second leg too: held + the second legs still to come
        room = self.held[g] + (self.nxt_f[down] - self.nxt_f[up]) + 2 <= self.cap or not self.train or self.forced
        for k in (up, down):  # the V's second leg first: it leads to the loss
            mb = self.nxt_f[k]
            if mb < M and self.fwd_ready(mb, k, now) and (k == up or room) and self.consumed(mb, k):
                return "F", mb, k
        if self.pending_w[g]:
            mb, k = self.pending_w[g][0]
            return "W", mb, k
        return None

    def consumed(self, mb: int, k: int) -> bool:
        """Forward ``mb`` of chunk k runs at most ``SEND_WINDOW`` micro-batches ahead of the forwards of the chunk
        its output goes to (a rank holds that many unfinished sends per peer and waits for the oldest: running
        further ahead, the first leg blocked before its second leg, which the group downstream waits for). The
        last chunk has no consumer, and zb-v's turn (chunks p-1 and p, on one group) sends nothing."""
        if k == self.V - 1 or chunk_group("zb-v", self.p, k) == chunk_group("zb-v", self.p, k + 1):
            return True
        return mb - self.nxt_f[k + 1] < SEND_WINDOW

    def returned(self, mb: int, k: int) -> bool:
        """The same bound on backward ``mb`` of chunk k, whose input gradient goes to chunk k-1."""
        if k == 0 or chunk_group("zb-v", self.p, k) == chunk_group("zb-v", self.p, k - 1):
            return True
        return mb - self.nxt_b[k - 1] < SEND_WINDOW

    def record(self, g: int, kind: str, mb: int, k: int) -> None:
        if kind == "F":
            self.nxt_f[k] += 1
            self.held[g] += 1
        elif kind == "B":
            self.nxt_b[k] += 1
            if k == 0:
                self.held[g] -= 1
            else:
                self.pending_w[g].append((mb, k))
        else:
            self.pending_w[g].pop(0)
            self.held[g] -= 1


def one_chunk_order(M: int, S: int, s: int, train: bool = True, split: bool = False) -> list[tuple[str, int]]:
    """Stage s of S under 1F1B as (F|B|W, micro-batch) in execution order (``train=False``: forwards only):
    min(S-s-1, M) warm-up forwards, then one forward and one backward in turn, then the drain. ``split``
    (schedule ``zb-h1``): every stage but the first splits each backward into B (input gradients, sent at
    once) and W (weight gradients) right after it; the last stage also runs its last B before the W of the
    micro-batch before it (``records.SCHEDULES``), so it ends holding two micro-batches' weight passes."""
    first, last = s == 0, s == S - 1
    warm = min(S - s - 1, M) if train else M
    split = split and train and not first
    out: list[tuple[str, int]] = [("F", j) for j in range(warm)]
    for i in range(M - warm):
        out += [("F", warm + i), ("B", i)] + ([("W", i)] if split else [])
    for j in range(M - warm, M) if train else ():
        out += [("B", j)] + ([("W", j)] if split else [])
    if split and last and M >= 2:  # ... F(M-1) B(M-1) W(M-2) W(M-1): the last gradient leaves one W sooner
        out.remove(("W", M - 2))
        out.insert(out.index(("B", M - 1)) + 1, ("W", M - 2))
    return out


def chunk_orders(plan: Plan, M: int, train: bool = True) -> list[Order]:
    """Per device group, its compute order under the plan's schedule (a one-chunk plan's group g runs chunk g)."""
    p, v = plan.num_stages, plan.num_chunks
    kind = schedule_kind(plan.schedule)
    if kind.placement == V_SHAPE:
        return zbv_orders([c.last - c.first for c in plan.pipeline], p, M, train, plan.chunk_pass_ms)
    if kind.chunked:
        return interleaved_orders(p, v, M, train)
    return [[(a, mb, g) for a, mb in one_chunk_order(M, p, g, train, kind.split_backward)] for g in range(p)]


def chunk_sizes(n_layers: int, v: int) -> list[int]:
    """``n_layers`` split into v chunks as evenly as possible (the first ones take the remainder)."""
    base, extra = divmod(n_layers, v)
    return [base + (1 if c < extra else 0) for c in range(v)]


def count_sizes(plan: Plan, schedule: str, v: int) -> list[int]:
    """Layer counts of the p*v chunks (pipeline order) giving every group as many layers as it holds now, cut into
    v near-equal chunks. Under interleaving this keeps every group's work exactly (the first layers stay on group 0,
    the last on group p-1); under zb-v the last layers move to group 0."""
    p = plan.num_stages
    sizes = []
    for g, st in enumerate(plan.stages):
        if st.layer_count() < v:
            raise ValueError(f"stages[{g}]: {st.layer_count()} layer(s) cannot be cut into {v} chunks")
        sizes.append(chunk_sizes(st.layer_count(), v))
    taken, flat = [0] * p, []
    for k in range(p * v):
        g = chunk_group(schedule, p, k)
        flat.append(sizes[g][taken[g]])
        taken[g] += 1
    return flat


def balanced_sizes(plan: Plan, schedule: str, v: int, chunk_s) -> list[int]:
    """``count_sizes``, then cut points moved one layer at a time while that lowers the busiest group's work, with
    ``chunk_s(group, first, last)`` pricing a chunk on its group: never worse than by count, and zb-v's group 0,
    which gains the last layers (a head far heavier than a block), sheds blocks to its neighbour. (Cutting every
    chunk to an equal share of time instead, tried first, moved whole layers between groups and lost the MILP's
    balance: +12% on the 4-type benchmark plan.) Under zb-v the exact cut (``v_sizes``) too, kept where its
    busiest group does less: the one-layer polish stalls where a move must shift two cuts at once (not past
    ``EXACT_V_CELLS``)."""
    p = plan.num_stages
    owner = [chunk_group(schedule, p, k) for k in range(p * v)]
    by_count = _polish(count_sizes(plan, schedule, v), owner, p, chunk_s)
    if schedule_kind(schedule).placement != V_SHAPE:
        return by_count
    n_layers = sum(st.layer_count() for st in plan.stages)
    if p * (n_layers + 1) ** 2 > EXACT_V_CELLS:
        return by_count
    by_time = _polish(v_sizes(p, n_layers, chunk_s), owner, p, chunk_s)
    # only a busiest group really less busy: equal loads cut by count keep the V's legs alike, which its order
    # needs (4 groups of A100s, gpt-1.3b: a V of 1-layer first legs at the same loads predicted 7% slower)
    if _score(by_time, owner, p, chunk_s)[0] < _score(by_count, owner, p, chunk_s)[0] * (1 - 1e-6):
        return by_time
    return by_count


def _score(sizes: list[int], owner: list[int], p: int, chunk_s) -> tuple[float, float]:
    """(the busiest group's work, the sum of squares of all groups'): what ``_polish`` lowers."""
    total, first = [0.0] * p, 0
    for k, n in enumerate(sizes):
        total[owner[k]] += chunk_s(owner[k], first, first + n)
        first += n
    return max(total), sum(x * x for x in total)


def v_sizes(p: int, n_layers: int, chunk_s, rounds: int = 48) -> list[int]:
    """zb-v's 2p chunk sizes that give the busiest group the least work, whatever each group held before.

    Why not cut by count: zb-v moves layers between groups (group g holds chunks g and 2p-1-g, so the head joins
    group 0), and on the 768-device plan the greedy cut left the busiest group 36% over the idlest. Why exact is
    cheap: the V nests. Group p-1 holds the two chunks at the turn, one interval [a, c); group p-2 the chunks on
    either side of it, and so on out to group 0, whose chunks reach layer 0 and the last layer. So for a bound T
    on any group's work, a sweep from the turn outwards marks which intervals [a, c) the inner groups can cover
    within T (an (L+1)^2 table per group, each built from the last by two running minima); T is then bisected.
    Work is priced per layer from ``chunk_s(g, 0, l)`` prefixes (exact for one device type per group;
    ``balanced_sizes`` re-scores and polishes with ``chunk_s`` itself). The turn group's two chunks split its
    interval where their times are closest."""
    L = n_layers
    if L < 2 * p:
        raise ValueError(f"layers: {L} cannot be cut into {2 * p} zb-v chunks")
    pre = np.array([[chunk_s(g, 0, l) for l in range(L + 1)] for g in range(p)])
    lo, hi = 0.0, float(max(pre[:, -1]))
    best = _v_cover(pre, hi)
    for _ in range(rounds):
        mid = (lo + hi) / 2
        got = _v_cover(pre, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
        if hi - lo <= 1e-6 * hi:
            break
    a, c = best  # per group its chunks' edges: [a[g], a[g+1]) and [c[g+1], c[g]), group p-1 [a[p-1], c[p-1])
    inner_a, inner_c = a[p - 1], c[p - 1]
    P = pre[p - 1]
    turn = inner_a + 1 + int(np.argmin([abs((P[m] - P[inner_a]) - (P[inner_c] - P[m])) for m in range(inner_a + 1, inner_c)]))
    cuts = [a[g] for g in range(p)] + [turn] + [c[g] for g in range(p - 1, -1, -1)]
    return [cuts[k + 1] - cuts[k] for k in range(2 * p)]


def _v_cover(pre: np.ndarray, bound: float) -> Optional[tuple[list[int], list[int]]]:
    """``v_sizes``' sweep for one bound: per group g its left edge a[g] and right edge c[g] (group g's chunks are
    [a[g], a[g+1]) and [c[g+1], c[g]); group p-1's one interval [a, c)), or None when no cut keeps every group
    within ``bound``. The state is the inner groups' whole interval (a, c): keeping only the farthest c per a is
    not enough, as every chunk holds a layer and the layer at c may be dear to the next group. Every chunk keeps a
    layer, and each edge leaves one layer per outer group."""
    p, L = pre.shape[0], pre.shape[1] - 1
    edge = np.arange(L + 1)
    a_, c_ = edge[:, None], edge[None, :]
    slack = bound * (1 + 1e-12)
    P = pre[p - 1]
    ok = (a_ >= p - 1) & (c_ <= L - (p - 1)) & (c_ >= a_ + 2) & (P[c_] - P[a_] <= slack)
    held = [ok]  # held[i]: intervals (a, c) groups p-1-i .. p-1 can cover within the bound
    for g in range(p - 2, -1, -1):
        P = pre[g]
        # the cheapest inner interval to wrap from (a', c'): min over a > a', c < c' of P[a] - P[c]
        inner = np.where(held[-1], P[a_] - P[c_], np.inf)
        inner = np.minimum.accumulate(inner[::-1], axis=0)[::-1]  # over a >= row
        inner = np.minimum.accumulate(inner, axis=1)  # over c <= column
        wrap = np.full_like(inner, np.inf)
        wrap[:-1, 1:] = inner[1:, :-1]  # strictly a > a' and c < c'
        ok = (a_ >= g) & (c_ <= L - g) & (wrap - P[a_] + P[c_] <= slack)
        held.append(ok)
    if not held[-1][0, L]:
        return None
    a, c = [0] * p, [L] * p
    for g in range(1, p):
        P, inner = pre[g - 1], held[p - 1 - g]
        cost = P[a_] - P[a[g - 1]] + P[c[g - 1]] - P[c_]
        fits = inner & (a_ > a[g - 1]) & (c_ < c[g - 1]) & (cost <= slack)
        # of the cuts that fit, the one whose two chunks on group g-1 take the most alike times
        legs = np.abs((P[a_] - P[a[g - 1]]) - (P[c[g - 1]] - P[c_]))
        a[g], c[g] = np.unravel_index(int(np.argmin(np.where(fits, legs, np.inf))), fits.shape)
        a[g], c[g] = int(a[g]), int(c[g])
    return a, c


def _polish(sizes: list[int], owner: list[int], p: int, chunk_s) -> list[int]:
    """Move single cut points by one layer while that lowers the busiest group's work (then the sum of squares):
    the greedy cut fills each chunk in turn, and a group whose chunks both ended a layer long paces the pipeline."""
    def score(sz):
        return _score(sz, owner, p, chunk_s)

    best, current = list(sizes), score(sizes)
    improved = True
    while improved:
        improved = False
        for k in range(len(best) - 1):  # the cut between chunk k and k + 1
            for step in (1, -1):
                trial = list(best)
                trial[k] += step
                trial[k + 1] -= step
                if min(trial[k], trial[k + 1]) < 1:
                    continue
                got = score(trial)
                if got < current:
                    best, current, improved = trial, got, True
    return best


def rechunk(plan: Plan, schedule: str, v: int, chunk_s=None) -> Plan:
    """The plan's device groups (ranks, widths, sample splits, tensor parallel) running ``schedule`` with v chunks
    each: group g keeps as many layers as it had, cut into v near-equal chunks placed by the contract's rule
    (``records.chunk_group``), so the work per group, and with it the balance the planner found, stays; only the
    fill, the boundary traffic and the in-flight memory change. A group with fewer than v layers cannot be cut:
    ValueError. ``v`` must be 2 under zb-v; 1 with ``1f1b``/``zb-h1`` gives the one-chunk plan back.

    ``chunk_s(group, first, last)`` (seconds of a chunk's forward and backward on that group's slowest replica):
    then move cut points where that balances the groups' work (``balanced_sizes``), for when the layers' costs
    differ (an embedding or a head far heavier than a block) and a group's chunks change which of them it holds."""
    p = plan.num_stages
    if not schedule_kind(schedule).chunked:
        v = 1
    flat = balanced_sizes(plan, schedule, v, chunk_s) if chunk_s is not None else count_sizes(plan, schedule, v)
    chunks: list[list[list[int]]] = [[] for _ in range(p)]
    first = 0
    for k, n in enumerate(flat):
        g = chunk_group(schedule, p, k)
        chunks[g].append([first, first + n])
        first += n
    stages = []
    for st, cs in zip(plan.stages, chunks):
        data = st.model_dump(exclude_none=True)
        data.pop("layers", None)
        data.pop("chunks", None)
        data["layers" if len(cs) == 1 else "chunks"] = cs[0] if len(cs) == 1 else cs
        stages.append(data)
    vendor = [plan.cluster.device_type(st.device_type).vendor for st in plan.stages]
    dtypes = {b.dtype for b in plan.boundaries}
    wire = dtypes.pop() if len(dtypes) == 1 else None
    placed = [chunk_group(schedule, p, k) for k in range(p * v)]
    boundaries = []
    for k in range(p * v - 1):
        host = vendor[placed[k]] != vendor[placed[k + 1]]
        if host or wire is not None:
            boundaries.append({"after_stage": k, "transport": "host" if host else "direct",
                               **({"dtype": wire} if wire is not None else {})})
    data = plan.model_dump(exclude_none=True)
    data.update(stages=stages, boundaries=boundaries, schedule=schedule)
    data.pop("predicted", None)
    data.pop("chunk_pass_ms", None)  # the old chunks' times (``evaluate.with_pass_times`` prices the new ones)
    return Plan.model_validate(data)
