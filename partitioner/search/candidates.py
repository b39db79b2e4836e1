"""Candidate stages, the vocabulary both searches share: for one micro-batch size, every stage a plan could use
(layer range, device type or two, width, tensor-parallel degree, recompute, ZeRO-1) with its costs, as parallel
numpy arrays; and the pricing of a chain of them (``objective_of``) that every search and the brute force agree on.

Every cost comes from ``CostModel`` (one home per formula); this module only enumerates and prunes.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import numpy as np

from ..costmodel import CostModel, host_copies_s, nic_queue_period_s, peak_memory_bytes
from ..records import ModelConfig
from ..schedule import peak_in_flight, trailing_weight_passes
from ..schedule_kinds import kind as schedule_kind

# The share of a neighbour's NIC traffic (the direction this stage's transfers use) that comes from elsewhere: a
# stage inside a chain of equals shares its neighbour's NIC with that neighbour's other neighbour
PEER_FOREIGN = 0.5
DEFAULT_MAX_UNITS = 48  # blocks grouped into at most this many units where the chain MILP would be too large


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
    # one way, the seconds from a send's post to its arrival on the busier of the stage's two boundaries, the NICs
    # free: two neighbours' dependency cycle adds it to their compute
    # (``evaluate.link_cycle_s``, which averages the two neighbours' compute where this charges each its own)
    latency_s: np.ndarray
    # the second type's tensor-parallel degree (a mixed stage whose replicas differ in degree: the faster type's at
    # ``tp``, the slower's at ``tp2`` >= tp; pure stages: tp)
    tp2: np.ndarray
    # the steady period a node's NIC queue sets: the node's replicas share its busier direction (their share of the
    # output's activations and of the input's gradients, ``_Part.nic_s``) and spend the rest of their cycle off it
    # (``_nic_cycle_s``; what ``evaluate.nic_cycle_s`` paces a plan by)
    nic_s: np.ndarray

    def __len__(self) -> int:
        return len(self.cost_s)

    @property
    def devices(self) -> np.ndarray:
        """Devices a candidate stage occupies, all types together: replicas x tensor-parallel degree."""
        return self.width * self.tp + self.width2 * self.tp2

    @property
    def pace_s(self) -> np.ndarray:
        """Steady-state seconds per micro-batch: sends are posted non-blocking, so a stage's compute and its
        transfers (one way's) overlap and the slower of the two paces the pipeline (fill and drain pay both); but a
        stage's next pass waits for its neighbour's data, so the compute on the dependency path plus the
        boundary's latency paces it too (``latency_s``)."""
        return self._paced(0.0)

    @property
    def hopped_pace_s(self) -> np.ndarray:
        """``pace_s`` when the next stage is on other hosts (another device type, or a mixed stage)."""
        return self._paced(self.hop_s)

    @property
    def bridged_pace_s(self) -> np.ndarray:
        """``pace_s`` when the next stage is another vendor's (the transfer goes through the host bridge)."""
        return self._paced(self.hop_s + self.bridge_s)

    def _paced(self, extra_s) -> np.ndarray:
        """``extra_s``: what the output boundary's transfers take more, both ways (half of it one way)."""
        path = self.cost_s - self.comm_s  # forward + backward, less a zb-h1 stage's W (off the path)
        # the activations and their gradients travel on separate groups and NIC directions: one way's time paces,
        # and so does a node's NIC queue, which carries one way of both boundaries
        return np.maximum(np.maximum(self.compute_s, np.maximum(self.comm_s / 2, self.nic_s) + extra_s / 2),
                          path + self.latency_s + extra_s / 2)

    def uses(self, ti: int) -> np.ndarray:
        """Devices of type ``ti`` each candidate occupies."""
        return np.where(self.type_idx == ti, self.width * self.tp, 0) + np.where(self.type2_idx == ti,
                                                                                  self.width2 * self.tp2, 0)

    def uses_matrix(self, n_types: int) -> np.ndarray:
        """(candidates, types) devices used."""
        return np.stack([self.uses(ti) for ti in range(n_types)], axis=1) if len(self) else np.zeros((0, n_types), int)


FIELDS = ("first_unit", "end_unit", "type_idx", "width", "recompute", "zero1", "cost_s", "compute_s", "comm_s",
          "allreduce_s", "optimizer_s", "in_flight", "vendor", "bridge_s", "tp", "type2_idx", "width2", "samples2",
          "hop_s", "latency_s", "tp2", "nic_s")


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


def units_for(model: ModelConfig, max_units: Optional[int]) -> list[tuple[int, int]]:
    """Planner layer ranges the solver may cut between: every layer, or equal chunks of blocks."""
    n = model.num_planner_layers
    max_units = DEFAULT_MAX_UNITS if max_units is None else max_units
    if n <= max_units:
        return [(l, l + 1) for l in range(n)]
    if model.measured:  # no embedding or head of its own: equal chunks of every layer
        size = math.ceil(n / max_units)
        return [(a, min(a + size, n)) for a in range(0, n, size)]
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
    if m.measured:  # no layer of a measured model declares a tensor-parallel split
        return [1]
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
    bwd_per_sample: np.ndarray  # ... of which the backward pass (``CostModel.backward_prefix``)
    bwd_fixed: np.ndarray
    extra_per_sample: np.ndarray  # what a split backward (zb-h1) adds (``CostModel.split_extra_prefix``)
    extra_fixed: np.ndarray
    params: np.ndarray  # per rank of a tp group
    act: np.ndarray  # activation bytes kept per in-flight sample
    act_max: np.ndarray  # largest layer's full activations per sample (recompute replays one at a time)
    in_bytes: np.ndarray
    out_bytes: np.ndarray
    per_node: int  # replicas (tp groups) one node of the type holds
    wait_over: np.ndarray  # per sample, what a split backward holds from B to W beyond ``act`` (``wait_bytes``)

    def compute_s(self, s: int) -> np.ndarray:
        return self.fixed + self.per_sample * s

    def split_compute_s(self, s: int, split: np.ndarray) -> np.ndarray:
        """``compute_s``, with the split backward's own cost where ``split``."""
        return self.compute_s(s) + np.where(split, self.extra_fixed + self.extra_per_sample * s, 0.0)

    def wgrad_s(self, s: int) -> np.ndarray:
        return self.wgrad_fixed + self.wgrad_per_sample * s

    def backward_s(self, s: int) -> np.ndarray:
        return self.bwd_fixed + self.bwd_per_sample * s

    def comm_s(self, w: int, s: int, cross: bool, other_host: bool = False) -> np.ndarray:
        """Output boundary per micro-batch: this part's share crosses to the next stage and the gradient comes
        back. Intra-node when the type's largest node holds the part and an equal neighbour. Inter-node: the
        replicas sharing a node share its NIC (as the evaluator and simulator model it), so a node's share
        queues on one link; a tp group's lead sends its replica's rows once. ``cross``: the next stage is
        another vendor's (host copies both ways, cross-vendor link). ``other_host``: the next stage is on other
        hosts (another device type: a host holds one), so the boundary is inter-node whatever the widths."""
        if cross:  # the node's share on the bridge's link, this replica's own share through its host copies
            per_x = min(w, self.per_node) * s
            return 2 * (self.cm.link_s(per_x * self.out_bytes, self.t, None, same_host=False)
                        + np.where(self.out_bytes > 0, host_copies_s(s * self.out_bytes), 0.0))
        intra = 2 * w <= self.per_node and not other_host
        per_link = s if intra else min(w, self.per_node) * s
        return 2 * self.cm.link_s(per_link * self.out_bytes, self.t, self.t, same_host=intra)

    def latency_s(self, w: int, s: int, inbound: bool, other_host: bool = False) -> np.ndarray:
        """One way, the seconds from a send's post to its arrival on the output (``inbound``: input) boundary,
        the NICs free (their queue is ``nic_s``'s: ``evaluate.boundary_latency_s``)."""
        nbytes = self.in_bytes if inbound else self.out_bytes
        intra = 2 * w <= self.per_node and not other_host
        return np.where(nbytes > 0, self.cm.link_s(s * nbytes, self.t, self.t, same_host=intra), 0.0)

    def nic_s(self, w: int, s: int, has_input: np.ndarray, other_host: bool = False) -> np.ndarray:
        """Per micro-batch, a node's NIC in either direction (``evaluate._nic_busy_s``): its share of the output's
        activations and of the input's gradients (the other direction carries the same back)."""
        def one_way(nbytes: np.ndarray) -> np.ndarray:
            intra = 2 * w <= self.per_node and not other_host
            return 0.0 if intra else self.cm.link_s(min(w, self.per_node) * s * nbytes, self.t, self.t,
                                                    same_host=False)
        return one_way(self.out_bytes) + np.where(has_input, one_way(self.in_bytes), 0.0)

    def in_flight(self, width: int, s: int, M: int, zero1: bool = False, waits=0, whole=None) -> np.ndarray:
        """Micro-batches in flight that fit (capped at M) with a stage of ``width`` replicas (ZeRO-1 shards its
        optimizer state over all of them) and a share of s samples. ``waits``: split backwards held at the peak
        (zb-h1: one right after a B, the last stage's last two), each holding ``wait_over`` more than a forward
        left (``evaluate.activation_peak_bytes`` counts the same along the stage's order). ``whole``: a stage mixing
        tensor-parallel degrees (``CostModel.state_bytes_of``)."""
        cap = self.cm.memory_limit_bytes(self.t) - peak_memory_bytes(
            self.cm.state_bytes_of(self.params, width, zero1, whole), waits * self.wait_over * s,
            self.act_max * s if self.rc else 0.0, self.in_bytes * s)
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
    waits = cum(cm.wait_bytes(tp))  # B rebuilt the whole graph, recomputed or not
    wait = waits[e] - waits[a]
    params = cm.range_params(a, e, tp)
    per_node = max(n.count for n in cm.cluster.nodes if n.device_type == t) // tp
    w_sample, w_call = cm.wgrad_prefix(t, tp)
    x_sample, x_call = cm.split_extra_prefix(t, tp)
    out = []
    for rc in ((False, True) if allow_recompute else (False,)):
        b_sample, b_call = cm.backward_prefix(t, rc, tp)
        out.append(_Part(cm, t, tp, rc, cm.prefix(t, rc, tp)[e] - cm.prefix(t, rc, tp)[a],
                         cm.prefix_fixed(t, rc, tp)[e] - cm.prefix_fixed(t, rc, tp)[a], w_sample[e] - w_sample[a],
                         w_call[e] - w_call[a], b_sample[e] - b_sample[a], b_call[e] - b_call[a],
                         x_sample[e] - x_sample[a], x_call[e] - x_call[a], params, act[rc],
                         act_max, lay.out_bytes[np.maximum(a - 1, 0)], lay.out_bytes[e - 1], per_node,
                         np.maximum(wait - act[rc], 0.0)))
    return out


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
               mixed: bool = True, schedule: str = "1f1b", zero1: bool = False, overlap: bool = True) -> Candidates:
    """Every feasible candidate stage for micro-batch size b (vectorised over unit ranges).

    ``width``: only stages of exactly this width (plans Megatron-core can express: equal widths; no mixed types).
    ``max_tp``: largest tensor-parallel degree (``tensor_parallel_degrees``); a candidate's devices are w x tp.
    ``pairs``: only these (first unit, end unit) ranges (default: all).
    ``mixed``: also stages that mix two device types of one vendor (``mixed_splits``), both at one degree.
    ``schedule``: a stage ending the pipeline must hold that schedule's in-flight count there (two under zb-h1
    when M >= 2; 1F1B's other counts are the chain's, checked by the solvers).
    ``zero1``: also pure stages of two or more replicas that shard their optimizer state (ZeRO-1), for the unit
    ranges where that lets them hold more micro-batches in flight (like recompute: never where it cannot help).
    ``overlap``: False prices the network as ``evaluate.no_overlap_s`` does (``PlannerOptions.network``).
    """
    bounds = np.array([u[0] for u in units] + [units[-1][1]])
    I, J = pairs if pairs is not None else np.triu_indices(len(bounds), k=1)
    build = _Builder(cm, types, M, bounds, I, J, schedule, overlap)
    parts: dict[tuple[str, int], list[_Part]] = {}
    for t in types:
        # a tensor-parallel group is one node's (consecutive slots): nodes of 1 and 3 devices hold one group of 2
        avail_of = lambda tp: min(counts[t] // tp, sum(n.count // tp for n in cm.cluster.nodes  # noqa: E731
                                                       if n.device_type == t))
        for tp in tensor_parallel_degrees(cm, t, max_tp):
            parts[t, tp] = _parts(cm, t, tp, allow_recompute, bounds, I, J)
            for part in parts[t, tp]:
                widths = widths_for(b, avail_of(tp)) if width is None else ([width] if width <= avail_of(tp) else [])
                for w in widths:
                    s = -(-b // w)
                    build.add(part, w, s)
                    if zero1 and w > 1 and not cm.zero1 and not part.rc:
                        build.add(part, w, s, z=True, only=_zero1_helps(parts[t, tp], w, s, M))
    if mixed and width is None:
        build.add_mixed(parts, b, counts, max_tp)
    return _prune_dominated(build.candidates())


class _Builder:
    """Collects candidate stages (one vectorised column per field) for ``candidates``."""

    def __init__(self, cm: CostModel, types: Sequence[str], M: int, bounds: np.ndarray, I: np.ndarray, J: np.ndarray,
                 schedule: str, overlap: bool = True):
        self.cm, self.types, self.M, self.I, self.J = cm, types, M, I, J
        self.overlap = overlap
        self.tied = cm.tied_params(bounds[I], bounds[J])  # a tied embedding/head weight shared with another stage
        self.vendor_of = {t: cm.cluster.device_type(t).vendor for t in types}
        self.vendor_ids = {v: n for n, v in enumerate(sorted(set(self.vendor_of.values())))}
        self.cols: dict[str, list] = {k: [] for k in FIELDS}
        self.index = {t: ti for ti, t in enumerate(types)}
        self.ends_pipeline = (J == len(bounds) - 1) & (I > 0)  # the last of two or more stages
        self.last_need = peak_in_flight(schedule, 2, 1, M)  # the last stage of any pipeline of two or more
        # zb-h1: a stage after the first sends its input gradient before its weights' (the fill and drain skip
        # them) and runs its last W (the last stage: its last two) before its all-reduce (``evaluate.iteration_s``)
        self.split = (I > 0) if schedule_kind(schedule).split_backward else np.zeros(len(I), dtype=bool)
        # (a middle stage as stage 1 of 3, the last as stage 1 of 2; the first never splits)
        # what a split stage holds at its peak from a B to its W (``in_flight``'s ``waits``)
        self.waits = np.where(self.split, np.where(self.ends_pipeline, min(2, M), 1), 0)
        self.tail_ws = np.where(I > 0, np.where(self.ends_pipeline, trailing_weight_passes(schedule, 2, 1, M),
                                                trailing_weight_passes(schedule, 3, 1, M)), 0)

    def add(self, pa: _Part, wa: int, sa: int, pb: Optional[_Part] = None, wb: int = 0, sb: int = 0,
            z: bool = False, only: Optional[np.ndarray] = None, whole: Optional[_Part] = None) -> None:
        """Stages of ``wa`` replicas of part ``pa`` taking ``sa`` samples each (plus ``wb`` of ``pb`` taking ``sb``:
        a mixed stage), with or without ZeRO-1, where ``only`` (default: every range) and memory allow. ``whole``:
        a degree-1 part of the same layers, whose parameters a stage of two degrees sums over all its ranks."""
        cm, M = self.cm, self.M
        w, ts = wa + wb, [pa.t] + ([pb.t] if pb is not None else [])
        # shards that do not align: gradients and ZeRO-1's state are whole tensors over every rank (mixed_tp, zero)
        whole_state = (whole.params, wa * pa.tp + wb * pb.tp) if pb is not None and pb.tp != pa.tp else None
        comp, comm, cross = pa.split_compute_s(sa, self.split), pa.comm_s(wa, sa, False), pa.comm_s(wa, sa, True)
        away = pa.comm_s(wa, sa, False, other_host=True)
        k, wg = pa.in_flight(w, sa, M, z, self.waits, whole_state), pa.wgrad_s(sa)
        tail, bwd = wg, pa.backward_s(sa)
        paced = comp if pb is None else np.maximum(comp, pb.split_compute_s(sb, self.split))
        path = paced - np.where(self.split, wg if pb is None else np.minimum(wg, pb.wgrad_s(sb)), 0.0)
        lat = self._latency_s(pa, wa, sa, pb is not None)
        if pb is not None:  # the slower half paces the stage; both halves' memory must hold
            lat = np.maximum(lat, self._latency_s(pb, wb, sb, True))
        nic = self._nic_cycle_s(pa, wa, sa, pb is not None, path + lat)
        if pb is not None:
            nic = np.maximum(nic, self._nic_cycle_s(pb, wb, sb, True, path + lat))
            # its halves sit on hosts of two types: whatever the next stage, one of them crosses hosts
            away = np.maximum(away, pb.comm_s(wb, sb, False, other_host=True))
            comp, comm = paced, away
            cross = np.maximum(cross, pb.comm_s(wb, sb, True))
            k = np.minimum(k, pb.in_flight(w, sb, M, False, self.waits, whole_state))
            # the fill skips the smaller of the halves' weight gradients, the all-reduce waits for the larger
            wg, tail = np.minimum(wg, pb.wgrad_s(sb)), np.maximum(tail, pb.wgrad_s(sb))
            bwd = np.minimum(bwd, pb.backward_s(sb))  # the all-reduce hides behind the shorter half's pass
        # ... plus the tied weight's all-reduce, over this stage and (about) as many replicas of the other
        # (what the last gradient pass leaves of the bucketed all-reduce: the last W under zb-h1, else the last B)
        hide = np.where(self.split, wg, bwd)
        if not self.overlap:  # ``evaluate.no_overlap_s``: transfers on the path, nothing hides the all-reduce
            comp, wg, lat, hide, tail = comp + comm, np.zeros_like(comp), np.zeros_like(comp), 0.0, 0.0
            nic = np.zeros_like(comp)
        params, ranks = whole_state or (pa.params, w)
        ar = (cm.sync_s(params, ts, ranks, pb is None and wa <= pa.per_node, z, hide)
              + cm.tie_sync_s(self.tied, ts, 2 * w) + self.tail_ws * tail)
        opt = np.max([cm.optimizer_s_of(p.params, p.t, w, z, whole_state) for p in (pa, pb) if p is not None], axis=0)
        k = np.where(self.ends_pipeline & (k < self.last_need), 0, k)
        keep = (k >= 1) & (only if only is not None else True)
        n = int(keep.sum())
        for name, values in (("first_unit", self.I[keep]), ("end_unit", self.J[keep]),
                             ("type_idx", np.full(n, self.index[pa.t])),
                             ("width", np.full(n, wa)), ("recompute", np.full(n, pa.rc)), ("zero1", np.full(n, z)),
                             ("cost_s", (comp + comm - np.where(self.split, wg, 0.0))[keep]), ("compute_s", comp[keep]),
                             ("comm_s", comm[keep]), ("allreduce_s", ar[keep]),
                             ("optimizer_s", opt[keep]),
                             ("in_flight", k[keep]), ("vendor", np.full(n, self.vendor_ids[self.vendor_of[pa.t]])),
                             ("bridge_s", np.maximum(cross - np.maximum(away, comm), 0.0)[keep]),
                             ("hop_s", np.maximum(away - comm, 0.0)[keep]), ("tp", np.full(n, pa.tp)),
                             ("latency_s", lat[keep]),
                             ("type2_idx", np.full(n, self.index[pb.t] if pb is not None else -1)),
                             ("width2", np.full(n, wb)), ("samples2", np.full(n, sb)),
                             ("tp2", np.full(n, pb.tp if pb is not None else pa.tp)),
                             ("nic_s", np.broadcast_to(nic, comp.shape)[keep])):
            self.cols[name].append(values)

    def _latency_s(self, part: _Part, w: int, s: int, mixed: bool) -> np.ndarray:
        """The busier boundary's one-way latency (``Candidates.latency_s``); the first stage has no input."""
        return np.maximum(part.latency_s(w, s, False, mixed),
                          np.where(self.I > 0, part.latency_s(w, s, True, mixed), 0.0))

    def _nic_cycle_s(self, part: _Part, w: int, s: int, mixed: bool, cycle_s: np.ndarray) -> np.ndarray:
        """``Candidates.nic_s``: the node's replicas of this part queue on its NIC (``nic_queue_period_s``), each
        spending the rest of its cycle (``cycle_s``: its path and one way's latency) off it. A neighbour's NIC also
        carries its other neighbour's traffic; half of it is foreign, as for a stage inside a chain of equals."""
        ranks = min(w, part.per_node)
        demand = part.nic_s(w, s, self.I > 0, mixed) / ranks
        return nic_queue_period_s(ranks, demand, np.maximum(cycle_s - demand, 0.0), PEER_FOREIGN)

    def add_mixed(self, parts: dict, b: int, counts: dict[str, int], max_tp: int) -> None:
        """Stages mixing two device types of one vendor (the faster first): at a degree both have, and, with
        ``max_tp`` > 1, the slower type's replicas at a larger degree than the faster's (an A100 at TP 1 beside
        V100s at TP 4: per-replica tensor parallelism)."""
        cm, types, index = self.cm, self.types, self.index
        speed = {t: cm.sample_s(t) for t in types}
        for ta, tb in itertools.permutations(types, 2):
            if self.vendor_of[ta] != self.vendor_of[tb] or (speed[ta], index[ta]) > (speed[tb], index[tb]):
                continue  # one vendor (a cross-vendor stage would all-reduce through the host); ta the faster
            degrees_a, degrees_b = (tensor_parallel_degrees(cm, t, max_tp) for t in (ta, tb))
            for tpa, tpb in ((x, y) for x in degrees_a for y in degrees_b if x <= y):
                whole = parts.get((ta, 1))
                if tpa != tpb and whole is None:
                    continue
                for k, (pa, pb) in enumerate(zip(parts[ta, tpa], parts[tb, tpb])):  # the same recompute setting
                    rep = [(float(cm.prefix_fixed(t, pa.rc, tp)[-1]), float(cm.prefix(t, pa.rc, tp)[-1]))
                           for t, tp in ((ta, tpa), (tb, tpb))]
                    for wa, wb, sb in mixed_splits(*rep[0], *rep[1], b, counts[ta] // tpa, counts[tb] // tpb):
                        self.add(pa, wa, -(-(b - wb * sb) // wa), pb, wb, sb, whole=whole[k] if whole else None)

    def candidates(self) -> Candidates:
        cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in self.cols.items()}
        cand = Candidates(**{k: cat[k] for k in self.cols})
        for name in ("first_unit", "end_unit", "type_idx", "width", "vendor", "tp", "type2_idx", "width2", "samples2",
                     "tp2"):
            setattr(cand, name, getattr(cand, name).astype(int))
        cand.recompute, cand.zero1 = cand.recompute.astype(bool), cand.zero1.astype(bool)
        return cand


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


def one_run_per_type(c: Candidates, chosen: Sequence[int]) -> bool:
    """Every device type serves one run of consecutive stages (a mixed stage counts for both of its types).
    Placement fills a type's hosts in stage order, so each host then holds consecutive stages: a rank order
    torchrun can start, which ``--equal-widths`` promises for ``export megatron``."""
    seen: set = set()
    prev: set = set()
    for k in chosen:
        here = {int(c.type_idx[k])} | ({int(c.type2_idx[k])} if c.type2_idx[k] >= 0 else set())
        if (here - prev) & seen:
            return False
        seen |= here
        prev = here
    return True


def chain_is_feasible(c: Candidates, chosen: Sequence[int], counts: Sequence[int], M: int) -> bool:
    """Devices of every type within the cluster's, and every stage holds 1F1B's in-flight count at its position."""
    ch = list(chosen)
    need = np.minimum(len(ch) - np.arange(len(ch)), M)
    used = np.zeros(len(counts), dtype=int)  # the chain's rows only: brute force asks at every complete chain
    np.add.at(used, c.type_idx[ch], c.width[ch] * c.tp[ch])
    two = [k for k in ch if c.type2_idx[k] >= 0]
    np.add.at(used, c.type2_idx[two], c.width2[two] * c.tp2[two])
    return bool((c.in_flight[ch] >= need).all() and (used <= np.asarray(counts)).all())


def restrict(c: Candidates, keep: np.ndarray) -> tuple[Candidates, np.ndarray]:
    idx = np.flatnonzero(keep)
    return Candidates(*(getattr(c, f)[idx] for f in FIELDS)), idx


class Job(NamedTuple):
    """One sub-problem of a search: a micro-batch size (and, with equal widths, a width) with its candidates and
    bounds."""

    lower_bound_s: float  # (M - 1) * t_lb + a bound on the sum of stage costs
    b: int  # micro-batch size
    M: int  # micro-batches per iteration
    cand: Candidates
    t_lb: float  # smallest bottleneck stage pace any chain fitting the devices can have
    width: Optional[int] = None  # with equal widths: the one width every stage has

    @property
    def key(self) -> tuple:
        return (self.b, self.width)
