"""The planner: non-uniform stages, per-stage device type and width, sample splits, micro-batch size,
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
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from .costmodel import PCIE_GBPS, CostModel
from .errors import InfeasibleError, InputError
from .placement import StageLayout, even_split
from .evaluate import REPLAY_WITHIN
from .records import MAX_MICRO_BATCHES, ModelConfig
from .schedule import SCHEDULES, peak_in_flight, trailing_weight_passes


@dataclass(frozen=True)
class PlannerOptions:
    solver: str = "highs"  # highs | cbc | brute-force
    time_limit_s: float = 60.0  # for the whole search, split over micro-batch sizes
    micro_batch_sizes: Optional[tuple[int, ...]] = None  # default: divisors of the global batch <= max
    max_micro_batch_size: int = 64
    allow_recompute: bool = True
    # Chunk the blocks into at most this many units (chain MILP). None: every layer is a cut point; models of
    # identical blocks longer than SHAPES_MIN_LAYERS go to the shape MILP, others are chunked at DEFAULT_MAX_UNITS.
    max_units: Optional[int] = None
    device_types: Optional[tuple[str, ...]] = None  # restrict to these types (fastest-only, homogeneous sums)
    # Every stage the same width w, each replica micro_batch / w samples: what Megatron-core's
    # parallel_state can express (stages may still differ in device type and layer count); no tensor parallelism.
    equal_widths: bool = False
    # Tensor-parallel degrees a stage may use: 1, 2, 4, 8 up to this (only those that fit in one node of the
    # type and divide heads, KV heads and the FFN size). 1 turns tensor parallelism off.
    max_tensor_parallel: int = 8
    # Stages may mix two device types of one vendor (``mixed_splits``: speed-proportional integer splits).
    mixed_types: bool = True
    # The pipeline schedule plans are written for (``schedule.SCHEDULES``): its memory (the last stage holds
    # two micro-batches under zb-h1) bounds the candidates, the replay that picks the plan runs it. 1F1B by
    # default: zb-h1 is opt-in until it is measured faster on GPUs (README: on CPU its two backward passes
    # cost about what its shorter drain saves).
    schedule: str = "1f1b"
    # A stage may shard its optimizer state over its replicas (ZeRO-1) where that lets it hold more micro-batches
    # in flight; --zero1 (the cost model's) shards every stage instead.
    zero1_stages: bool = True


@dataclass
class Candidates:
    """Candidate stages for one micro-batch size, as parallel numpy arrays (one entry per candidate)."""

    first_unit: np.ndarray  # first unit the stage holds
    end_unit: np.ndarray  # unit after its last (exclusive)
    type_idx: np.ndarray  # index into the planner's device types
    width: np.ndarray  # replicas
    recompute: np.ndarray  # full activation recompute (bool)
    zero1: np.ndarray  # optimizer state sharded over the replicas (bool)
    # What a stage adds to the fill and drain: forward + backward of a replica's share + its output transfers (under
    # zb-h1, less its weight gradients on every stage but the first: its B sends before its W)
    cost_s: np.ndarray
    compute_s: np.ndarray  # forward + backward per micro-batch (the transfers, posted non-blocking, overlap it)
    comm_s: np.ndarray  # output transfers per micro-batch
    allreduce_s: np.ndarray  # gradient all-reduce over the replicas (under zb-h1: after the W's that follow its last B)
    optimizer_s: np.ndarray  # optimizer step
    in_flight: np.ndarray  # micro-batches in flight that fit in memory (capped at M)
    vendor: np.ndarray  # vendor id of the device type
    bridge_s: np.ndarray  # extra per-micro-batch seconds, beyond hop_s, when the next stage is another vendor's
    tp: np.ndarray  # tensor-parallel degree: each replica is a group of tp devices on one node
    # A mixed-type stage adds width2 replicas of a second type (same vendor, same degree) taking samples2 samples
    # each; the width replicas of type_idx share the rest. Pure stages: type2_idx -1, width2 0.
    type2_idx: np.ndarray
    width2: np.ndarray
    samples2: np.ndarray
    # extra per-micro-batch seconds when the next stage is another device type's, or mixes types: a host holds
    # one type, so the output boundary then crosses hosts whatever ``comm_s`` assumed (``_hopped``)
    hop_s: np.ndarray

    def __len__(self) -> int:
        return len(self.cost_s)

    @property
    def devices(self) -> np.ndarray:
        """Devices a candidate stage occupies, all types together: replicas x tensor-parallel degree."""
        return (self.width + self.width2) * self.tp

    @property
    def pace_s(self) -> np.ndarray:
        """Steady-state seconds per micro-batch: sends are posted non-blocking, so a stage's compute and its
        transfers overlap and the slower of the two paces the pipeline (fill and drain still pay both)."""
        return np.maximum(self.compute_s, self.comm_s)

    @property
    def hopped_pace_s(self) -> np.ndarray:
        """``pace_s`` when the next stage is on other hosts (another device type, or a mixed stage)."""
        return np.maximum(self.compute_s, self.comm_s + self.hop_s)

    @property
    def bridged_pace_s(self) -> np.ndarray:
        """``pace_s`` when the next stage is another vendor's (the transfer goes through the host bridge)."""
        return np.maximum(self.compute_s, self.comm_s + self.hop_s + self.bridge_s)

    def uses(self, ti: int) -> np.ndarray:
        """Devices of type ``ti`` each candidate occupies."""
        return (np.where(self.type_idx == ti, self.width, 0) + np.where(self.type2_idx == ti, self.width2, 0)) * self.tp

    def uses_matrix(self, n_types: int) -> np.ndarray:
        """(candidates, types) devices used."""
        return np.stack([self.uses(ti) for ti in range(n_types)], axis=1) if len(self) else np.zeros((0, n_types), int)


FIELDS = ("first_unit", "end_unit", "type_idx", "width", "recompute", "zero1", "cost_s", "compute_s", "comm_s",
          "allreduce_s", "optimizer_s", "in_flight", "vendor", "bridge_s", "tp", "type2_idx", "width2", "samples2",
          "hop_s")


@dataclass
class Solution:
    b: int
    M: int
    chosen: list[int]  # candidate indices, in pipeline order
    objective: float
    bound: float
    status: str
    cands: Candidates = field(repr=False)
    units: Optional[list[tuple[int, int]]] = None  # the planner layer ranges cands' units index (default: units_for)


DEFAULT_MAX_UNITS = 48
# A search whose proven gap is within this is reported optimal: HiGHS's default relative MIP gap, where it stops
# and calls a MILP optimal itself.
OPTIMAL_GAP = 1e-4
# Models of identical blocks with more planner layers than this go to the shape MILP (``shapes``): on the
# 4-type benchmark (llama-7b, 34 layers, 64 devices) it proves its plan optimal in 11-13 s where the chain MILP
# ends its 60 s at a 28% gap. Shorter models keep the chain MILP, exact over every order of vendors.
SHAPES_MIN_LAYERS = 16


def units_for(model: ModelConfig, max_units: Optional[int]) -> list[tuple[int, int]]:
    """Planner layer ranges the solver may cut between: every layer, or equal chunks of blocks."""
    n = model.num_planner_layers
    max_units = DEFAULT_MAX_UNITS if max_units is None else max_units
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


def tensor_parallel_degrees(cm: CostModel, t: str, max_tp: int) -> list[int]:
    """1, 2, 4, 8 up to ``max_tp`` that fit in one node of type t and divide heads, KV heads and FFN size."""
    node_max = max(n.count for n in cm.cluster.nodes if n.device_type == t)
    m = cm.model
    return [d for d in (1, 2, 4, 8) if d <= max_tp and d <= node_max
            and m.num_attention_heads % d == 0 and m.kv_heads % d == 0 and m.ffn_hidden_size % d == 0]


def _range_max(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Table m[i, j] = max(values[bounds[i]:bounds[j]]) for unit boundaries i < j."""
    n = len(bounds)
    unit = np.array([values[bounds[k]:bounds[k + 1]].max() for k in range(n - 1)], dtype=float)
    m = np.zeros((n, n))
    for i in range(n - 1):
        m[i, i + 1:] = np.maximum.accumulate(unit[i:])  # running max over the units from i on
    return m


@dataclass(frozen=True)
class _Part:
    """The replicas of one device type in a candidate stage, priced over every unit range at once (arrays):
    what a pure stage is, and each of the two halves of a mixed-type stage."""

    cm: CostModel
    t: str
    tp: int
    rc: bool
    per_sample: np.ndarray  # seconds per sample of the range (forward + backward [+ recompute])
    fixed: np.ndarray  # seconds per call
    wgrad_per_sample: np.ndarray  # ... of which weight gradients (``CostModel.wgrad_prefix``)
    wgrad_fixed: np.ndarray
    params: np.ndarray  # per rank of a tp group
    act: np.ndarray  # activation bytes kept per in-flight sample
    act_max: np.ndarray  # largest layer's full activations per sample (recompute replays one at a time)
    in_bytes: np.ndarray
    out_bytes: np.ndarray
    per_node: int  # replicas (tp groups) one node of the type holds

    def compute_s(self, s: int) -> np.ndarray:
        return self.fixed + self.per_sample * s

    def wgrad_s(self, s: int) -> np.ndarray:
        return self.wgrad_fixed + self.wgrad_per_sample * s

    def comm_s(self, w: int, s: int, cross: bool, other_host: bool = False) -> np.ndarray:
        """Output boundary per micro-batch: this part's share crosses to the next stage and the gradient comes
        back. Intra-node when the type's largest node holds the part and an equal neighbour. Inter-node: the
        replicas sharing a node share its NIC (as the evaluator and simulator model it), so a node's share
        queues on one link; a tp group's lead sends its replica's rows once. ``cross``: the next stage is
        another vendor's (host copies both ways, cross-vendor link). ``other_host``: the next stage is on other
        hosts (another device type: a host holds one), so the boundary is inter-node whatever the widths."""
        if cross:
            net = self.cm.cluster.network
            gbps, lat = (net.cross_vendor_gbps or net.inter_node_gbps), net.inter_node_latency_us * 1e-6
            per_x = min(w, self.per_node) * s
            return np.where(self.out_bytes > 0, 2 * (lat + per_x * self.out_bytes * 8 / (gbps * 1e9)
                                                     + 2 * s * self.out_bytes / (PCIE_GBPS * 1e9)), 0.0)
        intra = 2 * w <= self.per_node and not other_host
        gbps, lat = self.cm._link_gbps(self.t, self.t, same_host=intra)
        per_link = s if intra else min(w, self.per_node) * s
        return np.where(self.out_bytes > 0, 2 * (lat + per_link * self.out_bytes * 8 / (gbps * 1e9)), 0.0)

    def in_flight(self, width: int, s: int, M: int, zero1: bool = False) -> np.ndarray:
        """Micro-batches in flight that fit (capped at M) with a stage of ``width`` replicas (ZeRO-1 shards its
        optimizer state over all of them) and a share of s samples."""
        cap = (self.cm.memory_limit_bytes(self.t) - self.cm.state_bytes_of(self.params, width, zero1)
               - 2.0 * self.in_bytes * s - (self.act_max * s if self.rc else 0.0))
        k = np.floor(np.where(cap > 0, cap / np.maximum(self.act * s, 1.0), 0.0))
        return np.minimum(k, M)


def _zero1_helps(parts: list[_Part], w: int, s: int, M: int) -> np.ndarray:
    """Unit ranges where a stage of ``w`` replicas should also be offered with ZeRO-1: sharding its optimizer
    state lets it hold more micro-batches in flight, and (where recompute is allowed) at least as many as
    recompute would, so that it replaces recompute's second forward by an all-gather. (Offering every range
    where it holds more doubled the 768-device benchmark's candidates and its gap at 60 s, for the same plan.)"""
    plain = parts[0].in_flight(w, s, M)
    sharded = parts[0].in_flight(w, s, M, True)
    helps = sharded > plain
    if len(parts) > 1:  # the recompute variant
        helps &= sharded >= parts[1].in_flight(w, s, M)
    return helps


def _parts(cm: CostModel, t: str, tp: int, allow_recompute: bool, bounds: np.ndarray, I: np.ndarray, J: np.ndarray
           ) -> list[_Part]:
    a, e = bounds[I], bounds[J]
    lay = cm.layers
    cum = lambda v: np.concatenate([[0.0], np.cumsum(v)])  # noqa: E731
    full_act = cm.act_bytes(tp)
    kept_rc = cum(lay.act_bytes_recompute)
    act = {False: cum(full_act)[e] - cum(full_act)[a], True: kept_rc[e] - kept_rc[a]}
    act_max = _range_max(full_act, bounds)[I, J]
    params = cm.range_params(a, e, tp)
    per_node = max(n.count for n in cm.cluster.nodes if n.device_type == t) // tp
    w_sample, w_call = cm.wgrad_prefix(t, tp)
    return [_Part(cm, t, tp, rc, cm.prefix(t, rc, tp)[e] - cm.prefix(t, rc, tp)[a],
                  cm.prefix_fixed(t, rc, tp)[e] - cm.prefix_fixed(t, rc, tp)[a], w_sample[e] - w_sample[a],
                  w_call[e] - w_call[a], params, act[rc], act_max,
                  lay.out_bytes[np.maximum(a - 1, 0)], lay.out_bytes[e - 1], per_node)
            for rc in ((False, True) if allow_recompute else (False,))]


# Mixed-type stages: at most this many (primary width, secondary width, split) per pair of types, degree and
# recompute setting, the ones closest to the pair's combined compute (see ``mixed_splits``).
MIXED_SPLITS = 3


def mixed_splits(fixed_a: float, per_a: float, fixed_b: float, per_b: float, b: int, avail_a: int, avail_b: int,
                 keep: int = MIXED_SPLITS) -> list[tuple[int, int, int]]:
    """(w_a, w_b, s_b) for mixed stages of a faster type a and a slower type b of one vendor: w_b replicas of b
    take s_b samples each, the w_a replicas of a share the rest (ceil); s_b is the speed-proportional integer
    split (the one that minimises the slower side on the whole model's per-sample and per-call seconds).

    Why only some: a mixed stage is worth a candidate only when it beats both pure stages made of its parts
    (w_a of a alone, w_b of b alone) and no mixed stage with no more devices of either type is as fast; of
    those, the ``keep`` that waste least of their devices' combined speed to integer rounding."""
    wa = np.arange(1, min(avail_a, b - 1) + 1)[:, None, None]
    wb = np.arange(1, min(avail_b, b - 1) + 1)[None, :, None]
    if not wa.size or not wb.size:
        return []
    sb = np.arange(1, b)[None, None, :]
    rest = b - wb * sb
    sa = -(-rest // wa)
    tau = np.where(rest >= wa, np.maximum(fixed_a + per_a * sa, fixed_b + per_b * sb), np.inf)
    best_s = tau.argmin(axis=2) + 1
    tau = tau.min(axis=2)
    wa2, wb2 = wa[:, :, 0], wb[:, :, 0]
    pure = np.minimum(fixed_a + per_a * -(-b // wa2), fixed_b + per_b * -(-b // wb2))
    lower_left = np.minimum.accumulate(np.minimum.accumulate(tau, axis=0), axis=1)
    shifted = np.full((tau.shape[0] + 1, tau.shape[1] + 1), np.inf)
    shifted[1:, 1:] = lower_left
    dominated = np.minimum(shifted[:-1, 1:], shifted[1:, :-1]) <= tau  # another with <= devices of each, as fast
    ok = np.isfinite(tau) & (tau < pure * (1 - 1e-9)) & ~dominated
    i, j = np.nonzero(ok)
    if not len(i):
        return []
    speed = b / tau[i, j] / (wa2[i, 0] / per_a + wb2[0, j] / per_b)  # share of the parts' combined speed
    order = np.lexsort((wa2[i, 0] + wb2[0, j], -speed))[:keep]
    return [(int(wa2[i[k], 0]), int(wb2[0, j[k]]), int(best_s[i[k], j[k]])) for k in order]


def candidates(cm: CostModel, units: list[tuple[int, int]], b: int, M: int, types: Sequence[str],
               counts: dict[str, int], allow_recompute: bool = True, width: Optional[int] = None,
               max_tp: int = 1, pairs: Optional[tuple[np.ndarray, np.ndarray]] = None,
               mixed: bool = True, schedule: str = "1f1b", zero1: bool = False) -> Candidates:
    """Every feasible candidate stage for micro-batch size b (vectorised over unit ranges).

    ``width``: only stages of exactly this width (plans Megatron-core can express: equal widths; no mixed types).
    ``max_tp``: largest tensor-parallel degree (``tensor_parallel_degrees``); a candidate's devices are w x tp.
    ``pairs``: only these (first unit, end unit) ranges (default: all).
    ``mixed``: also stages that mix two device types of one vendor (``mixed_splits``), both at one degree.
    ``schedule``: a stage ending the pipeline must hold that schedule's in-flight count there (two under zb-h1
    when M >= 2; 1F1B's other counts are the chain's, checked by the solvers).
    ``zero1``: also pure stages of two or more replicas that shard their optimizer state (ZeRO-1), for the unit
    ranges where that lets them hold more micro-batches in flight (like recompute: never where it cannot help).
    """
    bounds = np.array([u[0] for u in units] + [units[-1][1]])
    I, J = pairs if pairs is not None else np.triu_indices(len(bounds), k=1)
    tied = cm.tied_params(bounds[I], bounds[J])  # a tied embedding/head weight shared with another stage
    vendor_of = {t: cm.cluster.device_type(t).vendor for t in types}
    vendor_ids = {v: n for n, v in enumerate(sorted(set(vendor_of.values())))}
    cols: dict[str, list] = {k: [] for k in FIELDS}
    index = {t: ti for ti, t in enumerate(types)}
    ends_pipeline = (J == len(bounds) - 1) & (I > 0)  # the last of two or more stages
    last_need = peak_in_flight(schedule, 2, 1, M)  # the last stage of any pipeline of two or more
    # zb-h1: a stage after the first sends its input gradient before its weights' (the fill and drain skip them)
    # and runs its last W (the last stage: its last two) before its all-reduce (``evaluate.iteration_s``)
    split = (I > 0) if schedule == "zb-h1" else np.zeros(len(I), dtype=bool)
    # (a middle stage as stage 1 of 3, the last as stage 1 of 2; the first never splits)
    tail_ws = np.where(I > 0, np.where(ends_pipeline, trailing_weight_passes(schedule, 2, 1, M),
                                       trailing_weight_passes(schedule, 3, 1, M)), 0)

    def add(pa: _Part, wa: int, sa: int, pb: Optional[_Part] = None, wb: int = 0, sb: int = 0, z: bool = False,
            only: Optional[np.ndarray] = None) -> None:
        w, ts = wa + wb, [pa.t] + ([pb.t] if pb is not None else [])
        comp, comm, cross = pa.compute_s(sa), pa.comm_s(wa, sa, False), pa.comm_s(wa, sa, True)
        away = pa.comm_s(wa, sa, False, other_host=True)
        k, wg = pa.in_flight(w, sa, M, z), pa.wgrad_s(sa)
        tail = wg
        if pb is not None:  # the slower half paces the stage; both halves' memory must hold
            # its halves sit on hosts of two types: whatever the next stage, one of them crosses hosts
            away = np.maximum(away, pb.comm_s(wb, sb, False, other_host=True))
            comp, comm = np.maximum(comp, pb.compute_s(sb)), away
            cross, k = np.maximum(cross, pb.comm_s(wb, sb, True)), np.minimum(k, pb.in_flight(w, sb, M))
            # the fill skips the smaller of the halves' weight gradients, the all-reduce waits for the larger
            wg, tail = np.minimum(wg, pb.wgrad_s(sb)), np.maximum(tail, pb.wgrad_s(sb))
        # ... plus the tied weight's all-reduce, over this stage and (about) as many replicas of the other
        ar = (cm.sync_s(pa.params, ts, w, pb is None and wa <= pa.per_node, z) + cm.tie_sync_s(tied, ts, 2 * w)
              + tail_ws * tail)
        opt = np.max([cm.optimizer_s_of(pa.params, t, w, z) for t in ts], axis=0)
        k = np.where(ends_pipeline & (k < last_need), 0, k)
        keep = (k >= 1) & (only if only is not None else True)
        n = int(keep.sum())
        for name, values in (("first_unit", I[keep]), ("end_unit", J[keep]), ("type_idx", np.full(n, index[pa.t])),
                             ("width", np.full(n, wa)), ("recompute", np.full(n, pa.rc)), ("zero1", np.full(n, z)),
                             ("cost_s", (comp + comm - np.where(split, wg, 0.0))[keep]), ("compute_s", comp[keep]),
                             ("comm_s", comm[keep]), ("allreduce_s", ar[keep]),
                             ("optimizer_s", opt[keep]),
                             ("in_flight", k[keep]), ("vendor", np.full(n, vendor_ids[vendor_of[pa.t]])),
                             ("bridge_s", np.maximum(cross - np.maximum(away, comm), 0.0)[keep]),
                             ("hop_s", np.maximum(away - comm, 0.0)[keep]), ("tp", np.full(n, pa.tp)),
                             ("type2_idx", np.full(n, index[pb.t] if pb is not None else -1)),
                             ("width2", np.full(n, wb)), ("samples2", np.full(n, sb))):
            cols[name].append(values)

    parts: dict[tuple[str, int], list[_Part]] = {}
    for t in types:
        avail_of = lambda tp: counts[t] // tp  # noqa: E731
        for tp in tensor_parallel_degrees(cm, t, max_tp):
            parts[t, tp] = _parts(cm, t, tp, allow_recompute, bounds, I, J)
            for part in parts[t, tp]:
                widths = widths_for(b, avail_of(tp)) if width is None else ([width] if width <= avail_of(tp) else [])
                for w in widths:
                    s = -(-b // w)
                    add(part, w, s)
                    if zero1 and w > 1 and not cm.zero1 and not part.rc:
                        add(part, w, s, z=True, only=_zero1_helps(parts[t, tp], w, s, M))
    if mixed and width is None:
        speed = {t: cm.sample_s(t) for t in types}
        for ta, tb in itertools.permutations(types, 2):
            if vendor_of[ta] != vendor_of[tb] or (speed[ta], index[ta]) > (speed[tb], index[tb]):
                continue  # one vendor (a cross-vendor stage would all-reduce through the host); ta the faster
            common = set(tensor_parallel_degrees(cm, ta, max_tp)) & set(tensor_parallel_degrees(cm, tb, max_tp))
            for tp in sorted(common):
                for pa, pb in zip(parts[ta, tp], parts[tb, tp]):  # the same recompute setting
                    rep = [(float(cm.prefix_fixed(t, pa.rc, tp)[-1]), float(cm.prefix(t, pa.rc, tp)[-1]))
                           for t in (ta, tb)]
                    for wa, wb, sb in mixed_splits(*rep[0], *rep[1], b, counts[ta] // tp, counts[tb] // tp):
                        add(pa, wa, -(-(b - wb * sb) // wa), pb, wb, sb)
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}
    cand = Candidates(**{k: cat[k] for k in cols})
    for name in ("first_unit", "end_unit", "type_idx", "width", "vendor", "tp", "type2_idx", "width2", "samples2"):
        setattr(cand, name, getattr(cand, name).astype(int))
    cand.recompute, cand.zero1 = cand.recompute.astype(bool), cand.zero1.astype(bool)
    return _prune_dominated(cand)


def _prune_dominated(c: Candidates) -> Candidates:
    """Drop a candidate when another over the same layers and first device type uses no more devices of any
    type and is no worse in anything a chain is priced or checked by (cost, all-reduce, optimizer, host and bridge
    penalties, and micro-batches in flight; pure and mixed stages are never compared): swapping it in keeps any
    chain feasible and its objective no larger, so the optimum is unchanged. This is what keeps tensor-parallel
    and recompute variants from multiplying the MILP: most are dominated by a plain stage of the same devices."""
    if len(c) == 0:
        return c
    # pure and mixed stages apart: whether a stage mixes types decides whether the one before it crosses hosts
    group = ((c.first_unit * 1_000_003 + c.end_unit) * 64 + c.type_idx) * 65 + c.type2_idx + 1
    order = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.r_[True, group[order][1:] != group[order][:-1]])
    ends = np.r_[starts[1:], len(order)]
    n_types = int(max(c.type_idx.max(), c.type2_idx.max())) + 1
    scores = np.stack([-c.cost_s, -c.pace_s, -c.hopped_pace_s, -c.bridged_pace_s, -c.allreduce_s, -c.optimizer_s,
                       -c.hop_s, -c.bridge_s, c.in_flight], axis=1)
    better = np.concatenate([-c.uses_matrix(n_types), scores], axis=1)
    keep = np.ones(len(c), dtype=bool)
    for a, b in zip(starts, ends):
        idx = order[a:b]
        if len(idx) < 2:
            continue
        v = better[idx]
        ge = (v[:, None, :] >= v[None, :, :]).all(axis=2)  # ge[i, j]: i at least as good as j everywhere
        gt = (v[:, None, :] > v[None, :, :]).any(axis=2)
        strictly = ge & gt
        ties = ge & ~gt  # identical: keep the first of them
        np.fill_diagonal(ties, False)
        dominated = strictly.any(axis=0) | np.triu(ties, k=1).any(axis=0)
        keep[idx[dominated]] = False
    return Candidates(*(getattr(c, f)[keep] for f in FIELDS))


def _bridged(c: Candidates, ch: list[int]) -> np.ndarray:
    """Per stage of a chain: whether the next stage is another vendor's (the boundary goes through the host)."""
    v = c.vendor[ch]
    return np.r_[v[:-1] != v[1:], False] if len(ch) else np.zeros(0, dtype=bool)


def _hopped(c: Candidates, ch: list[int]) -> np.ndarray:
    """Per stage of a chain: whether the next stage sits on other hosts (another device type, or a stage mixing
    types): its output boundary is then inter-node (a host holds one type)."""
    t, t2 = c.type_idx[ch], c.type2_idx[ch]
    return np.r_[(t[:-1] != t[1:]) | (t2[1:] >= 0), False] if len(ch) else np.zeros(0, dtype=bool)


def stage_costs_of(c: Candidates, chosen: Sequence[int]) -> np.ndarray:
    """Per-micro-batch cost of each stage of a chain, with the inter-node price where the next stage is on other
    hosts and the bridge penalty where its vendor differs."""
    ch = list(chosen)
    return c.cost_s[ch] + np.where(_hopped(c, ch), c.hop_s[ch], 0.0) + np.where(_bridged(c, ch), c.bridge_s[ch], 0.0)


def stage_paces_of(c: Candidates, chosen: Sequence[int]) -> np.ndarray:
    """Steady-state seconds per micro-batch of each stage of a chain (``Candidates.pace_s``; hopped or bridged where
    the next stage is on other hosts or another vendor's)."""
    ch = list(chosen)
    return np.where(_bridged(c, ch), c.bridged_pace_s[ch], np.where(_hopped(c, ch), c.hopped_pace_s[ch], c.pace_s[ch]))


def objective_of(c: Candidates, chosen: Sequence[int], M: int) -> float:
    """The planning objective of a chain of candidates (same formula the MILP minimises)."""
    ch = list(chosen)
    return float((M - 1) * stage_paces_of(c, ch).max() + stage_costs_of(c, ch).sum() + c.allreduce_s[ch].max()
                 + c.optimizer_s[ch].max())


def chain_is_feasible(c: Candidates, chosen: Sequence[int], counts: Sequence[int], M: int) -> bool:
    """Devices of every type within the cluster's, and every stage holds 1F1B's in-flight count at its position."""
    ch = list(chosen)
    need = np.minimum(len(ch) - np.arange(len(ch)), M)
    used = np.zeros(len(counts), dtype=int)  # the chain's rows only: brute force asks at every complete chain
    np.add.at(used, c.type_idx[ch], c.width[ch] * c.tp[ch])
    two = [k for k in ch if c.type2_idx[k] >= 0]
    np.add.at(used, c.type2_idx[two], c.width2[two] * c.tp[two])
    return bool((c.in_flight[ch] >= need).all() and (used <= np.asarray(counts)).all())


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


def heuristic_chain(c: Candidates, U: int, counts: Sequence[int], M: int, T: float, weights: np.ndarray
                    ) -> Optional[list[int]]:
    """A memory-feasible chain with stages costing <= T that uses the fewest (weighted) devices; None when
    the chain found breaks a per-type device limit. Gives the MILP an incumbent to prune against."""
    dp, arg = chain_dp(c, U, M, c.uses_matrix(len(counts)) @ weights, c.pace_s <= T)
    r = int(dp[0].argmin())
    if not np.isfinite(dp[0, r]):
        return None
    chain, u = [], 0
    while u < U:
        k = int(arg[u, r])
        chain.append(k)
        u, r = int(c.end_unit[k]), r - 1
    return chain if chain_is_feasible(c, chain, counts, M) else None


def incumbent(c: Candidates, U: int, counts: Sequence[int], M: int, t_lb: float) -> Optional[list[int]]:
    """Best of a few heuristic chains at bottleneck thresholds a little above the lower bound."""
    counts_a = np.asarray(counts, dtype=float)
    best, best_obj = None, math.inf
    values = np.unique(c.pace_s)
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


class _Milp:
    """The candidate-chain MILP for one micro-batch size, built row family by row family."""

    def __init__(self, c: Candidates, U: int, M: int, z_lower: float):
        import pulp
        self.pulp, self.c, self.U, self.M = pulp, c, U, M
        self.prob = pulp.LpProblem("hethub_plan", pulp.LpMinimize)
        # PuLP >= 3.3 owns variables by the model (add_variable); older releases construct them directly.
        self.var = getattr(self.prob, "add_variable", None) or (
            lambda name, lowBound=None, upBound=None, cat="Continuous": pulp.LpVariable(name, lowBound, upBound, cat))
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

    def affine(self, terms) -> "object":
        return self.pulp.LpAffineExpression([(self.x[k], coef) for k, coef in terms])

    def flow_rows(self) -> None:
        """One chain of candidates from boundary 0 to boundary U."""
        lpSum, x = self.pulp.lpSum, self.x
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
            pmax = float(max(c.bridge_s[k] for k in self.ends[p]))
            if pmax <= 0:
                continue
            q = self.var(f"q_{p}", lowBound=0)
            self.prob += q >= self.affine([(k, float(c.bridge_s[k])) for k in self.ends[p]]) - pmax * (1 - z)
            self.prob.objective += q
            # the bottleneck: the ending stage's bridged pace when the vendor changes (vacuous when it does not)
            bmax = float(max(c.bridged_pace_s[k] for k in self.ends[p]))
            self.prob += self.Z >= self.affine([(k, float(c.bridged_pace_s[k])) for k in self.ends[p]]) - bmax * (1 - z)

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
            h = self.var(f"h_{p}", lowBound=0)
            self.prob += h >= self.affine([(k, float(c.hop_s[k])) for k in self.ends[p]]) - hmax * (1 - y)
            self.prob.objective += h
            pmax = float(max(c.hopped_pace_s[k] for k in self.ends[p]))
            self.prob += self.Z >= self.affine([(k, float(c.hopped_pace_s[k])) for k in self.ends[p]]) - pmax * (1 - y)

    def memory_rows(self) -> None:
        """Stages remaining from boundary u: r[u] = r[u+1] + (stages starting at u); a candidate that holds
        only k < M micro-batches in flight needs r[u] <= k."""
        r_next = None
        for u in range(self.U - 1, -1, -1):
            r = self.var(f"r_{u}", lowBound=0)
            self.prob += r == (r_next if r_next is not None else 0) + self.pulp.lpSum(self.x[k] for k in self.starts[u])
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


def _milp_solver(solver: str, time_limit_s: float, cutoff: Optional[float]):
    import pulp
    if solver == "highs":
        extra = {"objective_bound": float(cutoff)} if cutoff is not None else {}
        return pulp.HiGHS(msg=False, timeLimit=max(0.2, time_limit_s), presolve="off", threads=1, **extra)
    if solver == "cbc":
        import warnings
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC in favour of pulp[cbc]'s COIN_CMD
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))), threads=1)
    raise InputError("--solver", f"unknown MILP solver {solver!r}")


def solve_milp(c: Candidates, U: int, counts: Sequence[int], M: int, solver: str, time_limit_s: float,
               z_lower: float = 0.0, cutoff: Optional[float] = None) -> tuple[Optional[list[int]], float, float, str]:
    """(chosen candidates in order or None, objective, lower bound, status: optimal|feasible|infeasible|timeout).

    ``cutoff``: only solutions below it are of interest (an incumbent from another micro-batch size).

    ``z_lower`` is a valid lower bound on the bottleneck (``bottleneck_lower_bound``): with it the LP
    relaxation no longer spreads a fraction of every stage thin to make the bottleneck look cheap.
    """
    import pulp

    if len(c) == 0:
        return None, math.inf, math.inf, "infeasible"
    milp = _Milp(c, U, M, z_lower)
    milp.flow_rows()
    milp.load_rows()
    milp.vendor_rows()
    milp.host_rows()
    milp.memory_rows()
    milp.device_rows(counts)
    prob = milp.prob
    with _quiet_stdout():
        prob.solve(_milp_solver(solver, time_limit_s, cutoff))
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
    chosen = sorted((k for k in range(len(c)) if (milp.x[k].value() or 0) > 0.5), key=lambda k: c.first_unit[k])
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
    for k in np.argsort(c.cost_s, kind="stable"):
        starts[c.first_unit[k]].append(int(k))
    cc, ar, opt = c.cost_s.tolist(), c.allreduce_s.tolist(), c.optimizer_s.tolist()
    pc, hpc, bpc = c.pace_s.tolist(), c.hopped_pace_s.tolist(), c.bridged_pace_s.tolist()
    w, t = (c.width * c.tp).tolist(), c.type_idx.tolist()
    w2, t2 = (c.width2 * c.tp).tolist(), c.type2_idx.tolist()  # a mixed stage's second type (-1: none)
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
            if chain_is_feasible(c, chain, counts, M):
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


class _Job(NamedTuple):
    """One sub-problem: a micro-batch size (and, with equal widths, a width) with its candidates and bounds."""

    lower_bound_s: float  # (M - 1) * t_lb + a Lagrangian bound on the sum of stage costs
    key: tuple  # (micro-batch size, width or None)
    M: int
    cand: Candidates
    t_lb: float  # smallest bottleneck stage cost any chain fitting the device total can have


class _Search:
    """The search state over micro-batch sizes: incumbent, per-job bounds, the best chain per job."""

    def __init__(self, cm: CostModel, global_batch: int, opts: PlannerOptions, progress):
        self.cm, self.global_batch, self.opts, self.progress = cm, global_batch, opts, progress
        counts_all = cm.cluster.count_by_type()
        self.types = list(opts.device_types or cm.cluster.type_names)
        for t in self.types:
            if t not in counts_all:
                raise InputError("device_types", f"cluster {cm.cluster.name!r} has no {t!r} devices")
        self.counts = [counts_all[t] for t in self.types]
        self.U = len(units_for(cm.model, opts.max_units))
        self.sizes = micro_batch_sizes(global_batch, opts)
        self.t0 = time.perf_counter()
        self.brute = opts.solver == "brute-force"  # the reference: no bounding, every chain of every size
        self.best: Optional[Solution] = None
        self.pool: dict[tuple, Solution] = {}  # the best chain found per job
        self.milp_vars = 0
        self.jobs = self._make_jobs()
        self.bounds = {j.key: j.lower_bound_s for j in self.jobs}
        self.solved: dict[tuple, bool] = {}

    def _make_jobs(self) -> list[_Job]:
        """Candidates and lower bounds per job, most promising first."""
        opts, U, N = self.opts, self.U, sum(self.counts)
        units = units_for(self.cm.model, opts.max_units)
        # With equal widths, each (micro-batch size, width) pair is its own sub-problem.
        keys = ([(b, w) for b in self.sizes for w in range(1, min(b, max(self.counts)) + 1) if b % w == 0]
                if opts.equal_widths else [(b, None) for b in self.sizes])
        jobs = []
        for b, w in keys:
            M = self.global_batch // b
            cand = candidates(self.cm, units, b, M, self.types, dict(zip(self.types, self.counts)),
                              opts.allow_recompute, width=w, max_tp=opts.max_tensor_parallel, mixed=opts.mixed_types,
                              schedule=opts.schedule, zero1=opts.zero1_stages)
            t_lb = bottleneck_lower_bound(cand, U, N, M) if len(cand) else math.inf
            lb = (M - 1) * t_lb + sum_lower_bound(cand, U, N, M) if math.isfinite(t_lb) else math.inf
            jobs.append(_Job(lb, (b, w), M, cand, t_lb))
        return sorted(jobs, key=lambda j: j.lower_bound_s)

    def offer(self, sol: Solution, key: tuple) -> None:
        if key not in self.pool or sol.objective < self.pool[key].objective:
            self.pool[key] = sol
        if self.best is None or sol.objective < self.best.objective:
            self.best = sol

    def beaten(self, bound: float) -> bool:
        """No chain of that job could be replayed: its bound is past the replay window of the incumbent."""
        return self.best is not None and bound >= self.cutoff() * (1 - 1e-9)

    def cutoff(self) -> Optional[float]:
        """Each job's MILP looks for its best chain within ``REPLAY_WITHIN`` of the incumbent, not only below it:
        the closed form ranks, the replay decides (``choose_by_simulation``), and a chain a little above the
        incumbent by the closed form can replay faster (under zb-h1 the drain's overlap is not in the MILP)."""
        return None if self.best is None or self.brute else self.best.objective * REPLAY_WITHIN

    def seed_incumbents(self) -> None:
        """Heuristic chains for every job: the MILPs then only look below the best."""
        for job in self.jobs:
            if math.isfinite(job.t_lb):
                chain = incumbent(job.cand, self.U, self.counts, job.M, job.t_lb)
                if chain is not None:
                    self.offer(Solution(job.key[0], job.M, chain, objective_of(job.cand, chain, job.M),
                                        job.lower_bound_s, "feasible", job.cand), job.key)

    def attempt(self, job: _Job, seconds: float) -> None:
        """Solve one job (restricted to candidates that can beat the incumbent) within ``seconds``."""
        if not self.brute and (not math.isfinite(job.lower_bound_s) or self.beaten(job.lower_bound_s)):
            self.solved[job.key] = True
            return
        cut = self.cutoff()
        sub, back = (restrict(job.cand, job.cand.pace_s <= cut / job.M * (1 + 1e-9)) if cut is not None
                     else (job.cand, np.arange(len(job.cand))))
        if self.brute:
            res = solve_brute_force(sub, self.U, self.counts, job.M, deadline=self.t0 + self.opts.time_limit_s,
                                    time_limit_s=self.opts.time_limit_s)
            chosen, obj, bound, status = (None, math.inf, math.inf, "infeasible") if res is None else \
                (res[0], res[1], res[1], "optimal")
        else:
            self.milp_vars += len(sub)
            chosen, obj, bound, status = solve_milp(sub, self.U, self.counts, job.M, self.opts.solver, seconds,
                                                    z_lower=job.t_lb, cutoff=cut)
        self.bounds[job.key] = max(self.bounds[job.key], bound if status != "infeasible" else
                                   (cut if cut is not None else math.inf))
        self.solved[job.key] = status in ("optimal", "infeasible")
        if self.progress is not None:
            self.progress({"micro_batch_size": job.key[0], "done": sum(self.solved.values()), "total": len(self.jobs),
                           "incumbent_s": self.best.objective if self.best is not None else math.inf,
                           "bound_s": min(self.bounds.values()), "elapsed_s": time.perf_counter() - self.t0})
        if chosen is not None:
            self.offer(Solution(job.key[0], job.M, [int(back[k]) for k in chosen], obj, bound, status, job.cand),
                       job.key)

    def run(self) -> None:
        """Pass 1: every job briefly, most promising first (an early incumbent prunes the rest);
        pass 2: the jobs left unproven, with the remaining time."""
        if not self.brute:
            self.seed_incumbents()
        quick = self.opts.time_limit_s / (2 * max(1, len(self.jobs)))
        for job in self.jobs:
            self.attempt(job, min(quick, 2.0))
        for k, job in enumerate(self.jobs):
            if self.solved.get(job.key) or self.beaten(self.bounds[job.key]):
                continue
            left = self.opts.time_limit_s - (time.perf_counter() - self.t0)
            if left <= 0.2:
                break
            self.attempt(job, left / max(1, sum(1 for j in self.jobs[k:] if not self.solved.get(j.key))))

    def stats(self) -> dict:
        gap = max(0.0, (self.best.objective - min(self.bounds.values())) / self.best.objective)
        return {"seconds": time.perf_counter() - self.t0, "micro_batch_sizes": self.sizes,
                "candidates": sum(len(j.cand) for j in self.jobs), "units": self.U, "milp_variables": self.milp_vars,
                "gap": gap, "status": "optimal" if gap <= OPTIMAL_GAP else "feasible",
                "alternatives": sorted(self.pool.values(), key=lambda s: s.objective)}


def search(cm: CostModel, global_batch: int, opts: PlannerOptions = PlannerOptions(),
           progress: Optional[Callable[[dict], None]] = None) -> tuple[Solution, dict]:
    """Best solution over micro-batch sizes; also returns search statistics (``alternatives``: the best
    chain of every micro-batch size, for the simulator to choose among).

    ``progress``, if given, is called after every MILP with the search's state (micro-batch size just
    solved, sizes done/total, incumbent and lower bound in seconds, elapsed seconds): a live status.

    Micro-batch sizes are visited in order of their lower bound M * T_lb (T_lb: the smallest
    bottleneck any chain fitting the device total can have); a size whose bound cannot beat the
    incumbent is skipped, and candidates costing more than incumbent / M are dropped before the MILP
    (no stage of a better plan can cost more). Both cuts are exact.
    """
    if global_batch < 1:
        raise InputError("--global-batch", f"must be >= 1, got {global_batch}")
    if opts.schedule not in SCHEDULES:
        raise InputError("--schedule", f"expected one of {', '.join(SCHEDULES)}, got {opts.schedule!r}"[:120])
    if opts.equal_widths:  # what Megatron-core can run: one width, (here) no tensor parallelism, no per-stage ZeRO
        opts = replace(opts, max_tensor_parallel=1, zero1_stages=False)
    if _layer_granular_shapes(cm, opts):
        from .shapes import ShapeSearch
        types = list(opts.device_types or cm.cluster.type_names)
        counts_all = cm.cluster.count_by_type()
        for t in types:
            if t not in counts_all:
                raise InputError("device_types", f"cluster {cm.cluster.name!r} has no {t!r} devices")
        counts = [counts_all[t] for t in types]
        sizes = micro_batch_sizes(global_batch, opts)
        shape = ShapeSearch(cm, global_batch, opts, progress, types, counts, sizes)
        shape.run()
        if shape.best is None and shape.ran_out():
            raise InfeasibleError("--time-limit", f"no plan found within {opts.time_limit_s:g} s (some micro-batch "
                                                  f"sizes were not searched to the end); raise it")
        if shape.best is None:
            raise _infeasible(cm, global_batch, types, counts, sizes)
        return shape.best, shape.stats()
    warm = None
    types = opts.device_types or cm.cluster.type_names
    can_split = any(len(tensor_parallel_degrees(cm, t, opts.max_tensor_parallel)) > 1 for t in types)
    if can_split and cm.cluster.num_devices > 16 and opts.solver != "brute-force":
        # Tensor-parallel candidates multiply the space; the plain space first (half the time) gives an
        # incumbent, so the full search only looks below it and is never worse than no tensor parallelism.
        t0 = time.perf_counter()
        try:
            warm = _Search(cm, global_batch, replace(opts, max_tensor_parallel=1, time_limit_s=opts.time_limit_s / 2),
                           progress)
            warm.run()
        except InfeasibleError:
            warm = None
        opts = replace(opts, time_limit_s=max(opts.time_limit_s - (time.perf_counter() - t0), 1.0))
    s = _Search(cm, global_batch, opts, progress)
    if warm is not None and warm.best is not None:
        s.best = warm.best
        s.pool.update({("no-tp",) + k: v for k, v in warm.pool.items()})
    s.run()
    if s.best is None:
        raise _infeasible(cm, global_batch, s.types, s.counts, s.sizes)
    return s.best, s.stats()


def _layer_granular_shapes(cm: CostModel, opts: PlannerOptions) -> bool:
    """Plan a model of identical blocks at layer granularity with the shape MILP (``shapes``) unless the
    user asked for chunks (``max_units``), a fixed width or the brute-force reference."""
    from .shapes import identical_blocks
    n = cm.model.num_planner_layers
    types = list(opts.device_types or cm.cluster.type_names)
    return (opts.max_units is None and n > SHAPES_MIN_LAYERS and not opts.equal_widths
            and opts.solver != "brute-force" and identical_blocks(cm, types, opts.max_tensor_parallel))


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
    tie = (f"; its tied embedding/head weight is held by both end stages "
           f"({cm.state_bytes(0, 1) / 2**30:.1f} GiB of state on the first)" if cm.tied_params(0, 1) else "")
    return InfeasibleError("memory", f"no stage layout of {cm.model.name!r} fits the devices' memory at any "
                                     f"micro-batch size in {bs} (1F1B keeps up to one micro-batch per later stage "
                                     f"in flight{tie}); add devices or use a smaller global batch")


def solution_layouts(sol: Solution, units: list[tuple[int, int]], types: list[str]) -> list[StageLayout]:
    c = sol.cands
    units = sol.units or units
    out = []
    for k in sol.chosen:
        wb, sb = int(c.width2[k]), int(c.samples2[k])
        # a mixed stage: the first type's replicas share what the second's (s_b each) leave
        samples = even_split(sol.b - wb * sb, int(c.width[k])) + (sb,) * wb
        second = (types[c.type2_idx[k]],) * wb if wb else ()
        out.append(StageLayout(layers=(units[c.first_unit[k]][0], units[c.end_unit[k] - 1][1]),
                               device_type=types[c.type_idx[k]], samples=samples, recompute=bool(c.recompute[k]),
                               zero1=bool(c.zero1[k]),
                               tensor_parallel=int(c.tp[k]),
                               replica_types=(types[c.type_idx[k]],) * int(c.width[k]) + second if wb else ()))
    return out
