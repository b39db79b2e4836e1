"""Analytic cost model: per-layer time and memory on every accelerator type, and link times.

Sources for the formulas:
- FLOPs of a transformer block: 2 FLOPs per multiply-accumulate over every matmul (QKV, scores
  QK^T, AV, output projection, MLP), as in Narayanan et al. 2021 ("Efficient Large-Scale Language
  Model Training on GPU Clusters", eq. 3) without their causal-mask halving; backward = 2 x forward.
- Activation bytes kept for backward per block and sample: Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", sec. 4.1): s*h*(34 + 5*a*s/h) bytes with
  16-bit activations; generalised here to any ffn size / SwiGLU, and without the 5*a*s^2 term when
  attention is fused (flash attention keeps no s x s matrix).
- Mixed-precision Adam: 16 bytes per parameter (2 weight + 2 grad + 4 master + 4 + 4 moments,
  Rajbhandari et al. 2020, ZeRO sec. 3.1); ZeRO-1 shards the 12 optimizer bytes over a stage's
  replicas.

Time of layer l on type T per sample = FLOPs / (peak_T(dtype) x efficiency_T), where efficiency_T
is the device type's achievable fraction (``DeviceType.efficiency``) or calibrated from a measured
profile; a measured per-layer time wins over the analytic one (per layer and device type).
All times in seconds, sizes in bytes, unless the name says otherwise.
"""
from __future__ import annotations



from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Sequence

import numpy as np
import pulp

from .errors import InputError
from .quiet import quiet_stdout
from .records import Cluster, ModelConfig, Plan, Profile

# Bytes per element of activations, the tensors crossing a stage boundary and gradients, by training dtype:
# 16-bit formats keep 16-bit activations (fp8 too: matmul inputs are cast per layer, the residual stream stays
# 16-bit); fp32 and tf32 keep 32-bit ones, fp64 64-bit. (An fp32 run priced at 16 bits sent twice the bytes
# predicted: 2.9x measured vs 1.9x predicted slow-down on a 5 Mbit/s link, benchmarks/multihost.py.)
ELEMENT_BYTES = {"fp8": 2.0, "bf16": 2.0, "fp16": 2.0, "tf32": 4.0, "fp32": 4.0, "fp64": 8.0}
# Adam's optimizer state per parameter, by training dtype: with 16-bit weights an fp32 master copy and two
# fp32 moments (Rajbhandari et al. 2020, "ZeRO", section 3.1); with 32/64-bit weights the two moments alone.
# (hethub's own bf16 is autocast over fp32 weights: 8 + 8 bytes, the same 16 per parameter in all.)
ADAM_STATE_BYTES = {"fp8": 12.0, "bf16": 12.0, "fp16": 12.0, "tf32": 8.0, "fp32": 8.0, "fp64": 16.0}
# weights + gradients per parameter, by training dtype
WEIGHT_GRAD_BYTES = {"fp8": 4.0, "bf16": 4.0, "fp16": 4.0, "tf32": 8.0, "fp32": 8.0, "fp64": 16.0}
# bytes per element on the wire of a boundary that casts to this dtype (fp8: codes + one fp32 scale per hidden
# vector, ~1 byte for hidden sizes in the thousands)
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
# bytes per gradient element the data-parallel all-reduce moves, by training dtype: hethub's runtime keeps
# parameters (so gradients) in fp32 under a 16-bit autocast, fp64 in an fp64 run (pricing them at 2 bytes under
# bf16 predicted half the all-reduce the runtime runs)
GRAD_BYTES = {"fp8": 4.0, "bf16": 4.0, "fp16": 4.0, "tf32": 4.0, "fp32": 4.0, "fp64": 8.0}
PCIE_GBPS = 25.0  # GB/s, host<->device copy of a PCIe 4.0 x16 link (device -> pinned host buffer)
# The data-parallel gradient all-reduce runs in buckets of this many MiB (the runtime's default, ds_config
# "hetero": {"bucket_mb": ...}), each started as the backward finishes its gradients (DDP's 25 MiB).
DEFAULT_BUCKET_MB = 25.0
# the share of mean-value analysis's queue a transfer waits for at its own NIC (``nic_queue_period_s``): a pipeline's
# ranks post in a staggered rhythm, not at random, so a transfer finds less queued than the analysis of random
# arrivals says. Fitted on the replay (a NIC booked in posting order): with the whole queue the closed form of 18
# of 23 plans the MILP ranked (before this refit) on cases of 128-320 devices was within 5% of its replay (up to 10%
# pessimistic), with half of it all 23 (0.950-1.035), and 204 of 206 stored plans (174 with the whole queue, up to
# 16%); the plans today's MILP ranks there: 24 of 24.
NIC_WAIT_SHARE = 0.5
OPTIMIZER_PASSES = 2.0  # optimizer step reads and writes its 16 B/param state once each (memory-bound)


def block_forward_flops(m: ModelConfig) -> float:
    """FLOPs of one transformer block's forward for one sample (sequence)."""
    s, h, ffn = m.seq_length, m.hidden_size, m.ffn_hidden_size
    kv = h * m.kv_heads // m.num_attention_heads
    qkv = 2 * s * h * (h + 2 * kv)
    scores = 2 * s * s * h  # Q K^T over all heads
    context = 2 * s * s * h  # softmax(.) V
    proj = 2 * s * h * h
    mlp = 2 * s * h * ffn * (3 if m.architecture == "llama" else 2)  # SwiGLU has gate, up, down
    return float(qkv + scores + context + proj + mlp)


def block_params(m: ModelConfig) -> int:
    h, ffn = m.hidden_size, m.ffn_hidden_size
    kv = h * m.kv_heads // m.num_attention_heads
    if m.architecture == "llama":  # no biases, two RMSNorm weights
        return h * h * 2 + 2 * h * kv + 3 * h * ffn + 2 * h
    # GPT: biases on every linear, two LayerNorms (weight + bias)
    return (h * (h + 2 * kv) + (h + 2 * kv)) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 4 * h


def block_activation_split(m: ModelConfig, flash_attention: bool = True) -> tuple[float, float]:
    """(replicated, tensor-parallel-split) bytes one block keeps for backward per sample (16-bit activations),
    Korthikanti et al. 2022 generalised: what lives per head or per FFN column is split t ways under tensor
    parallelism, what lives on the full hidden size (norm inputs, the inputs of QKV and fc1, dropout masks) is not.
    """
    s, h, ffn, a = m.seq_length, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    kv = h * m.kv_heads // a
    dropout = m.architecture == "gpt"
    # attention: LN input 2sh, QKV input 2sh, dropout mask sh | Q,K,V 2s(h+2kv), projection input 2sh
    rep = 2 * s * h + 2 * s * h + (s * h if dropout else 0)
    split = 2 * s * (h + 2 * kv) + 2 * s * h
    if not flash_attention:
        split += 5 * a * s * s  # softmax output 2as^2, dropout mask as^2, dropout output 2as^2
    if m.architecture == "llama":  # RMSNorm input, gate/up input | gate/up outputs, act(gate)*up
        rep += 2 * s * h + 2 * s * h
        split += 3 * 2 * s * ffn
    else:  # LN input, fc1 input, dropout mask | GeLU input, fc2 input
        rep += 2 * s * h + 2 * s * h + s * h
        split += 2 * s * ffn + 2 * s * ffn
    return float(rep), float(split)


def block_activation_bytes(m: ModelConfig, flash_attention: bool = True) -> float:
    """Bytes one block keeps for backward per sample (16-bit activations), Korthikanti et al. 2022 generalised."""
    return sum(block_activation_split(m, flash_attention))


def block_replicated_params(m: ModelConfig) -> int:
    """Parameters of a block that tensor parallelism does not split: norms and the row-parallel biases."""
    h = m.hidden_size
    return 2 * h if m.architecture == "llama" else 4 * h + 2 * h  # GPT: two LayerNorms, proj and fc2 biases


@dataclass
class LayerCosts:
    """Per planner layer, per sample: FLOPs, parameters, activation bytes, bytes crossing its output."""

    flops_fwd: np.ndarray
    params: np.ndarray
    act_bytes: np.ndarray  # kept for backward without recompute
    act_bytes_recompute: np.ndarray  # kept with full recompute: the layer's input only
    out_bytes: np.ndarray  # activation leaving the layer (a stage boundary after it sends this)
    mem_bytes_fwd: np.ndarray  # bytes a memory-bound layer moves in forward (embedding lookups)
    mem_bytes_bwd: np.ndarray  # ... and in backward (the embedding's dense weight gradient)
    # Tensor parallelism (Megatron-style, blocks only): the parts of params/act_bytes it splits t ways, and
    # whether a layer is split at all (embedding and head run replicated on every rank of a group)
    params_split: np.ndarray = None
    act_split: np.ndarray = None
    tp_split: np.ndarray = None
    # The share of a layer's backward that computes weight gradients (the rest computes its input's gradient):
    # a schedule that splits backward (``zb-h1``) sends the input gradient upstream first and runs this later.
    wgrad_share: np.ndarray = None
    # What a layer whose backward is split holds between the two passes beyond ``act_bytes`` (per sample): the
    # output gradients its weight pass waits with (autograd keeps the rest of its graph for the weights outside
    # plain Linears). Negative where a measured layer frees more than that adds (``with_measured_activations``).
    wait_extra: np.ndarray = None


def block_matmul_flops(m: ModelConfig) -> float:
    """The part of ``block_forward_flops`` that multiplies by a weight (QKV, output projection, MLP): each has
    one weight-gradient matmul of the same size in backward (dW = X^T dY), the rest of backward (dX = dY W^T,
    and the attention core's gradients, which touch no weight) computes input gradients."""
    s, h, ffn = m.seq_length, m.hidden_size, m.ffn_hidden_size
    kv = h * m.kv_heads // m.num_attention_heads
    return float(2 * s * h * (h + 2 * kv) + 2 * s * h * h + 2 * s * h * ffn * (3 if m.architecture == "llama" else 2))


def measured_layer_costs(m: ModelConfig) -> LayerCosts:
    """A measured model's layers (``ModelConfig.measured_layers``): what ``hethub profile --script`` measured of
    each, no formula. No FLOPs (its times come from the profiles only), no tensor-parallel split; a backward
    splits half and half unless a profile measured its two passes."""
    ls = m.measured_layers
    n = len(ls)
    params = np.array([float(x.params) for x in ls])
    out = np.array([x.output_bytes for x in ls])
    out[-1] = 0.0  # the last layer's output is the loss's input: it crosses no boundary
    zeros = np.zeros(n)
    return LayerCosts(zeros.copy(), params, np.array([x.activation_bytes for x in ls]),
                      np.array([x.input_bytes for x in ls]), out, zeros.copy(), zeros.copy(), zeros.copy(),
                      zeros.copy(), np.zeros(n, dtype=bool), np.full(n, 0.5), zeros.copy())


def layer_costs(m: ModelConfig, flash_attention: bool = True, element_bytes: float = 2.0) -> LayerCosts:
    """Per planner layer costs; activations of ``element_bytes`` per element (``ELEMENT_BYTES`` by dtype)."""
    if m.measured:
        return measured_layer_costs(m)
    s, h, v = m.seq_length, m.hidden_size, m.vocab_size
    n = m.num_planner_layers
    e = float(element_bytes)
    flops = np.zeros(n)
    params = np.zeros(n)
    act = np.zeros(n)
    act_rc = np.zeros(n)
    out = np.full(n, e * s * h)
    mem = np.zeros(n)
    mem_b = np.zeros(n)
    # embedding: lookup (+ learned positions for GPT); memory-bound
    params[0] = v * h + (s * h if m.architecture == "gpt" else 0)
    mem[0] = e * s * h * 2
    mem_b[0] = 4.0 * params[0]  # zero + accumulate a dense gradient as large as the table (fp32)
    flops[0] = s * h  # position add; negligible
    act[0] = act_rc[0] = 8 * s  # token ids (int64)
    # blocks
    flops[1:-1] = block_forward_flops(m)
    params[1:-1] = block_params(m)
    act[1:-1] = block_activation_bytes(m, flash_attention) * e / 2  # the formula counts 16-bit activations
    act_rc[1:-1] = e * s * h
    # head: final norm + LM head (+ the loss's logits kept for backward)
    flops[-1] = 2.0 * s * h * v
    params[-1] = v * h + 2 * h  # tied or not, the head's stage holds the vocab x hidden weight (CostModel.range_params)
    act[-1] = e * s * h * 2 + loss_saved_bytes(m)  # norm input, head input, the loss's fp32 log-probabilities
    act_rc[-1] = act[-1]
    out[-1] = 0.0
    split_p, split_a, tp = np.zeros(n), np.zeros(n), np.zeros(n, dtype=bool)
    split_p[1:-1] = block_params(m) - block_replicated_params(m)
    split_a[1:-1] = block_activation_split(m, flash_attention)[1] * e / 2
    tp[1:-1] = True
    wshare = np.full(n, 0.5)  # head: dW and dX are one matmul each
    wshare[0] = 1.0  # embedding: its backward is the weight's gradient alone (token ids have none)
    wshare[1:-1] = block_matmul_flops(m) / (2.0 * block_forward_flops(m))  # backward = 2 x forward
    wait = np.zeros(n)  # the embedding's backward is never split (its input, token ids, has no gradient)
    wait[1:-1] = e * s * block_weighted_outputs(m)
    wait[-1] = e * s * (h + v)  # the final norm's output gradient, the logits'
    return LayerCosts(flops, params, act, act_rc, out, mem, mem_b, split_p, split_a, tp, wshare, wait)


def block_weighted_outputs(m: ModelConfig) -> float:
    """Per position: elements of a block's outputs that feed a weight's gradient (QKV, output projection, MLP in
    and out, the two norms), whose gradients a split backward's weight pass waits with."""
    h, ffn = m.hidden_size, m.ffn_hidden_size
    kv = h * m.kv_heads // m.num_attention_heads
    return float((h + 2 * kv) + h + ffn * (2 if m.architecture == "llama" else 1) + h + 2 * h)


@dataclass
class DeviceCosts:
    """Forward/backward seconds of every planner layer on one device type: fixed + per-sample x samples.

    The fixed part (launch and framework overhead per call) is fitted where profiles at two or more
    micro-batch sizes exist; it is 0 for the analytic model and for single-size profiles.
    """

    fwd_s: np.ndarray  # per sample
    bwd_s: np.ndarray
    efficiency: float
    measured: np.ndarray  # bool per layer: from a profile
    fwd_fixed_s: np.ndarray = None  # per call
    bwd_fixed_s: np.ndarray = None
    # The backward split in two passes (zb-h1, zb-v), per layer, as fractions of its backward (per sample; per
    # call): the weight pass, and what the two passes take beyond one backward (``split_ratios``).
    split: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = None

    def __post_init__(self):
        if self.fwd_fixed_s is None:
            self.fwd_fixed_s = np.zeros_like(self.fwd_s)
        if self.bwd_fixed_s is None:
            self.bwd_fixed_s = np.zeros_like(self.bwd_s)


TRAINING_DTYPES = ("bf16", "fp16", "fp32")  # what the runtime trains in (16-bit: autocast over fp32 weights)
# the ds_config that makes the runtime train in each (hethub.runtime.precision reads these sections)
DS_CONFIG_FOR = {"bf16": '"bf16": {"enabled": true}', "fp16": '"fp16": {"enabled": true} (dynamic loss scaling)',
                 "fp32": "no bf16/fp16 section"}


def natural_dtype(cluster: Cluster, types: Optional[Sequence[str]] = None) -> tuple[str, str]:
    """(dtype, why): the cheapest training dtype every device type (of ``types``, default all) computes in
    hardware: bf16, else fp16 (a V100 or T4 among them: fp16 with dynamic loss scaling), else fp32."""
    names = list(types or cluster.type_names)

    def lacking(dtype: str) -> str:
        return ", ".join(t for t in names if not cluster.device_type(t).native(dtype))
    if not lacking("bf16"):
        return "bf16", "every device type computes bf16"
    if not lacking("fp16"):
        return "fp16", f"no bf16 on {lacking('bf16')}"
    return "fp32", f"no bf16 on {lacking('bf16')}, no fp16 on {lacking('fp16')}"


def cost_model_for(plan: Plan, profiles: Sequence[Profile] = (), **kw) -> "CostModel":
    """The cost model a written plan was priced with: its cluster, model and dtype (bf16 for plans written
    before plans recorded it)."""
    return CostModel(plan.cluster, plan.model, dtype=plan.dtype or "bf16", profiles=profiles, **kw)


def ring_allreduce(nbytes, ranks: int):
    """(bytes each rank moves over its link, latency hops) of a ring all-reduce over ``ranks``: a
    reduce-scatter and an all-gather, each (n-1)/n of the buffer in n-1 steps. ``nbytes`` may be an array."""
    return 2 * (ranks - 1) / ranks * nbytes, 2 * (ranks - 1)


def nic_queue_period_s(ranks: int, demand_s, think_s, foreign=0.0, foreign_wait_s=0.0):
    """The steady period of ``ranks`` ranks sharing one host NIC direction: each period a rank spends
    ``think_s`` off the NIC (its compute and its transfers' own time on the path) and puts ``demand_s`` of
    transfers on the NIC. Mean-value analysis of that closed queue (one customer per rank): with k - 1 ranks
    queued ahead a transfer waits for a share of theirs, R_k = D (1 + w Q_{k-1}) with w ``NIC_WAIT_SHARE``, and
    the NIC passes k / (Z + R_k) per second. The bare NIC bound (ranks * D) is its limit; with few ranks and
    short compute the queue itself paces (eight one-sample replicas per stage, four to a host at 12 Gbit/s: the
    queue adds 8% to the NIC's load, and the closed form is 3.8% above the replay, 13% with the whole queue). A
    transfer holds both NICs at once, so it also waits at the peer: ``foreign_wait_s`` seconds
    (``nic_queue_seen``'s queue there), or, where the peer's queue is not known, ``foreign`` (the share of the
    peer's traffic from other hosts) of this one's queue. Exact at one rank (Z + D); arrays work elementwise."""
    return _nic_queue(ranks, demand_s, think_s, foreign, foreign_wait_s)[0] * ranks


def nic_queue_seen(ranks: int, demand_s, think_s):
    """How many transfers one arriving at this NIC direction finds ahead of it, by the arrival theorem the
    queue ``nic_queue_period_s``'s recursion holds with one rank fewer (0 for a lone rank). The peer's side of
    a transfer waits for these (without that wait 20 of 206 stored plans were beyond 5% of their replay, up to
    9.3% optimistic: one-sample V100 replicas, four to a host, feeding four-sample A100s)."""
    return _nic_queue(ranks, demand_s, think_s)[1]


def _nic_queue(ranks: int, demand_s, think_s, foreign=0.0, foreign_wait_s=0.0):
    """(1 / throughput at ``ranks`` ranks, the queue at ``ranks`` - 1)."""
    think, demand = np.asarray(think_s, dtype=float), np.asarray(demand_s, dtype=float)
    queue, period = np.zeros_like(think + demand), think + demand
    seen = queue
    for k in range(1, ranks + 1):
        seen = queue
        own = demand * (1.0 + NIC_WAIT_SHARE * queue)
        period = np.maximum(think + own + foreign * demand * queue + foreign_wait_s, 1e-30) / k
        period = np.maximum(period, demand)  # a partial wait must not pass the NIC more than one D at a time
        queue = own / period
    return period, seen


def allreduce_end_s(allreduce_s, buckets, ends_s, hides_s):
    """When a bucketed all-reduce of ``allreduce_s`` seconds in ``buckets`` equal buckets ends, given each
    replica's last gradient pass (it ends at ``ends_s[q]`` after ``hides_s[q]`` seconds and fills the
    buckets at an even rate, last layers first).

    Why this form: bucket k is ready once every replica has filled it, at max_q(end_q - hide_q (1 - (k+1)/n)),
    and the buckets run one after another, a/n each, so the last ends at max_k(ready_k + (n - k) a/n); that
    is the largest of a convex function of k, so one of its ends: the first bucket (ready after 1/n of the
    slowest-starting pass) plus the whole all-reduce, or the last pass's end plus one bucket. For one replica
    the exposed part is max(a/n, a - hide (n-1)/n): a two-stage pipeline of n pieces. The backward's own
    speed is taken as unchanged by the concurrent reduction (on a GPU NCCL uses its own SMs and stream)."""
    a, n = np.asarray(allreduce_s, dtype=float), np.asarray(buckets, dtype=float)
    ends, hides = np.asarray(ends_s, dtype=float), np.asarray(hides_s, dtype=float)  # last axis: replicas
    first_ready = np.max(ends - hides * (1.0 - 1.0 / n)[..., None], axis=-1)
    return np.maximum(np.max(ends, axis=-1) + a / n, first_ready + a)


def work_bound_samples_per_s(layer_s: dict[str, np.ndarray], counts: dict[str, int]) -> float:
    """Samples/s no placement of layers on devices can exceed (no communication, no memory limit).

    Why not "each device alone runs the whole model": the types' speed ratio differs between layers (memory-
    bound embedding and head vs compute-bound blocks; more so under measured profiles), so a plan that gives
    each type the layers it is relatively good at beats that sum (a profiled plan printed 296% of it). The
    bound is the fractional assignment LP: max X with, per layer l, sum_t x_lt = X samples/s, and per type
    t, sum_l x_lt * s_lt <= count_t device-seconds per second. Should the LP solver fail, the closed form
    X <= sum_t count_t * max_l(best_l / s_lt) / sum_l best_l (each device at its relatively best layer's
    speed) is returned: looser, still a bound."""
    types = [t for t in counts if counts[t] > 0]
    best = np.min(np.stack([layer_s[t] for t in types]), axis=0)
    loose = sum(counts[t] * float(np.max(best / np.maximum(layer_s[t], 1e-300))) for t in types) / float(best.sum())
    prob = pulp.LpProblem("upper_bound", pulp.LpMaximize)
    var = getattr(prob, "add_variable", None) or pulp.LpVariable  # PuLP >= 3.3 owns variables by the model
    x_total = var("X", lowBound=0, upBound=loose)
    x = {(l, t): var(f"x_{l}_{i}", lowBound=0) for l in range(len(best)) for i, t in enumerate(types)}
    prob += x_total
    for l in range(len(best)):
        prob += pulp.lpSum(x[l, t] for t in types) == x_total
    for t in types:  # seconds scaled by the slowest layer time keep the LP's coefficients near 1
        prob += pulp.lpSum(x[l, t] * float(layer_s[t][l] / best.max()) for l in range(len(best))) \
            <= counts[t] / float(best.max())
    with quiet_stdout():
        status = prob.solve(pulp.HiGHS(msg=False, threads=1))
    if pulp.LpStatus[status] != "Optimal" or x_total.value() is None:
        return loose
    return min(loose, float(x_total.value()) * (1.0 + 1e-9))  # the solver's tolerance, on the safe side


@dataclass
class CostModel:
    """Times and memory for every (layer range, device type, samples) the planner asks about."""

    cluster: Cluster
    model: ModelConfig
    dtype: str = "bf16"
    flash_attention: bool = True
    memory_reserve_gib: float = 2.0  # kept free on every device (CUDA context, fragmentation)
    zero1: bool = False
    profiles: Sequence[Profile] = ()
    bucket_mb: float = DEFAULT_BUCKET_MB  # the runtime's gradient bucket (ds_config "hetero": {"bucket_mb"})
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.dtype not in ELEMENT_BYTES:  # priced as bf16 before: a typo must not plan in silence
            raise InputError("CostModel.dtype", f"expected one of {', '.join(ELEMENT_BYTES)}, got "
                                                f"{str(self.dtype)[:40]!r}")
        self.element_bytes = ELEMENT_BYTES[self.dtype]
        self.grad_bytes = GRAD_BYTES.get(self.dtype, 4.0)
        self.layers = with_measured_activations(layer_costs(self.model, self.flash_attention, self.element_bytes),
                                                self.profiles, loss_saved_bytes(self.model))
        self._params_cum = np.concatenate([[0.0], np.cumsum(self.layers.params)])
        self._split_cum = np.concatenate([[0.0], np.cumsum(self.layers.params_split)])
        self._tp_times: dict[tuple[str, int], tuple] = {}
        self._tied_params = float(self.model.vocab_size * self.model.hidden_size) if self.model.tie_embeddings else 0.0
        self.devices: dict[str, DeviceCosts] = {}
        self._tp_profiles: dict[tuple[str, int], list[Profile]] = {}
        by_type: dict[str, list[Profile]] = {}
        for i, p in enumerate(self.profiles):
            if p.device_type not in self.cluster.type_names:
                raise InputError(f"profiles[{i}].device_type", f"profile is for {p.device_type!r}, which cluster "
                                                               f"{self.cluster.name!r} does not have "
                                                               f"({', '.join(self.cluster.type_names)})")
            if p.model.shape_key() != self.model.shape_key():
                raise InputError(f"profiles[{i}].model", f"profile was measured on model {p.model.name!r} "
                                                         f"({_shape(p.model)}), planning model {self.model.name!r} "
                                                         f"is {_shape(self.model)}")
            if p.tensor_parallel > 1:  # measured split: replaces the analytic TP terms for that (type, degree)
                self._tp_profiles.setdefault((p.device_type, p.tensor_parallel), []).append(p)
            else:
                by_type.setdefault(p.device_type, []).append(p)
        for t in self.cluster.type_names:
            self.devices[t] = self._device_costs(t, by_type.get(t, []))

    # ---------------------------------------------------------------- compute
    def _analytic(self, t: str, efficiency: float, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        dt = self.cluster.device_type(t)
        flops_per_s = dt.peak(dtype) * 1e12 * efficiency
        mem_per_s = dt.memory_gbps * 1e9 * min(1.0, 2 * efficiency)  # bandwidth is easier to reach than peak
        fwd = np.maximum(self.layers.flops_fwd / flops_per_s, self.layers.mem_bytes_fwd / mem_per_s)
        bwd = np.maximum(2.0 * self.layers.flops_fwd / flops_per_s, self.layers.mem_bytes_bwd / mem_per_s)
        return fwd, bwd

    def _device_costs(self, t: str, profiles: list[Profile]) -> DeviceCosts:
        dt = self.cluster.device_type(t)
        n = self.model.num_planner_layers
        measured = np.zeros(n, dtype=bool)
        efficiency = dt.efficiency
        split = split_ratios(self.layers.wgrad_share, profiles)
        if self.model.measured:
            return measured_device_costs(self, t, profiles, split)
        if not profiles:
            fwd, bwd = self._analytic(t, efficiency, self.dtype)
            return DeviceCosts(fwd, bwd, efficiency, measured, split=split)
        measured, fwd_m, bwd_m, fwd_a, bwd_a = measured_times(self.model.num_planner_layers, profiles)
        # One efficiency factor for the type, from the measured compute-bound layers (blocks and head).
        efficiency = calibrate_efficiency(self.model, self.cluster.device_type(t).peak(profiles[0].dtype),
                                          {lp.index: lp.forward_ms + lp.backward_ms for lp in profiles[0].layers},
                                          profiles[0].micro_batch_size, self.flash_attention) or efficiency
        fwd, bwd = self._analytic(t, efficiency, self.dtype)
        fwd[measured], bwd[measured] = fwd_m[measured], bwd_m[measured]
        if not measured.all():
            missing = np.flatnonzero(~measured)
            self.notes.append(f"profile for {t} lacks layers {_ranges(missing)}: analytic cost model used for them "
                              f"(efficiency {efficiency:.3f})")
        return DeviceCosts(fwd, bwd, efficiency, measured, fwd_a, bwd_a, split)

    def tp_measured(self, t: str, tp: int) -> bool:
        """Whether (type, degree) has a profile measured tensor-parallel (else the analytic terms apply)."""
        return tp > 1 and (t, tp) in self._tp_profiles

    def layer_times(self, t: str, tp: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(forward per sample, backward per sample, forward per call, backward per call) seconds of every layer
        on a device of type t, in a tensor-parallel group of ``tp`` devices of that type.

        Megatron-style tensor parallelism (Shoeybi et al. 2019) splits each block: QKV and the first MLP
        matrices column-parallel, the attention output projection and the last MLP matrix row-parallel, so a
        block's compute is divided by tp and its output needs an all-reduce after attention and after the MLP
        (two in forward, two in backward, each of s x h activations per sample, ring, on the type's
        intra-node link). The embedding, the norms and the head are replicated: every rank of the group runs
        them whole. Measured (tp = 1) profiles get the same terms on top; a profile measured at this degree
        (``hethub profile --tensor-parallel``) replaces them for the layers it has.
        """
        key = (t, tp)
        cached = self._tp_times.get(key)
        if cached is not None:
            return cached
        d = self.devices[t]
        fwd, bwd, fwd_fixed, bwd_fixed = d.fwd_s.copy(), d.bwd_s.copy(), d.fwd_fixed_s.copy(), d.bwd_fixed_s.copy()
        if tp > 1:
            split = self.layers.tp_split
            fwd[split] /= tp
            bwd[split] /= tp
            per_sample, per_call = self.tp_allreduce_s(t, tp)
            for arr, add in ((fwd, per_sample), (bwd, per_sample), (fwd_fixed, per_call), (bwd_fixed, per_call)):
                arr += add
        if self.tp_measured(t, tp):
            m, fwd_m, bwd_m, fwd_a, bwd_a = measured_times(self.model.num_planner_layers, self._tp_profiles[(t, tp)])
            fwd[m], bwd[m], fwd_fixed[m], bwd_fixed[m] = fwd_m[m], bwd_m[m], fwd_a[m], bwd_a[m]
        self._tp_times[key] = (fwd, bwd, fwd_fixed, bwd_fixed)
        return self._tp_times[key]

    def tp_allreduce_s(self, t: str, tp: int) -> tuple[np.ndarray, np.ndarray]:
        """Per layer: (seconds per sample, seconds per call) of one pass's tensor-parallel all-reduces — two per
        block (after attention, after the MLP), each a ring over ``tp`` devices of s x h activations per
        sample on the type's intra-node link; 0 for the replicated embedding and head."""
        n = self.model.num_planner_layers
        if tp <= 1:
            return np.zeros(n), np.zeros(n)
        gbps, lat = self._link_gbps(t, t, same_host=True)
        volume, hops = ring_allreduce(self.element_bytes * self.model.seq_length * self.model.hidden_size, tp)
        split = self.layers.tp_split
        return np.where(split, 2 * volume * 8 / (gbps * 1e9), 0.0), np.where(split, 2 * hops * lat, 0.0)

    def stage_tp_allreduce_s(self, t: str, first: int, last: int, samples: float, recompute: bool, tp: int
                             ) -> tuple[float, float]:
        """(forward, backward) seconds of a stage's tensor-parallel all-reduces: the part of
        ``stage_compute_s`` the timeline shows as collectives (recompute repeats the forward's)."""
        per_sample, per_call = self.tp_allreduce_s(t, tp)
        one = float(per_call[first:last].sum() + per_sample[first:last].sum() * samples)
        return one, one * (2 if recompute else 1)

    def prefix(self, t: str, recompute: bool = False, tp: int = 1) -> np.ndarray:
        """Cumulative per-sample (fwd + bwd [+ recompute fwd]) seconds over layers: stage time = p[b] - p[a]."""
        fwd, bwd, _, _ = self.layer_times(t, tp)
        per_layer = fwd + bwd + (fwd if recompute else 0.0)
        return np.concatenate([[0.0], np.cumsum(per_layer)])

    def prefix_fixed(self, t: str, recompute: bool = False, tp: int = 1) -> np.ndarray:
        """Cumulative per-call fixed seconds (same layout as ``prefix``)."""
        _, _, fwd, bwd = self.layer_times(t, tp)
        per_layer = fwd + bwd + (fwd if recompute else 0.0)
        return np.concatenate([[0.0], np.cumsum(per_layer)])

    def backward_prefix(self, t: str, recompute: bool = False, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Cumulative (per-sample, per-call) backward [+ recompute forward] seconds (layout of ``prefix``): the pass
        the bucketed gradient all-reduce overlaps."""
        fwd_s, bwd_s, fwd_c, bwd_c = self.layer_times(t, tp)
        rc = 1.0 if recompute else 0.0
        return (np.concatenate([[0.0], np.cumsum(bwd_s + rc * fwd_s)]),
                np.concatenate([[0.0], np.cumsum(bwd_c + rc * fwd_c)]))

    def stage_compute_s(self, t: str, first: int, last: int, samples: float, recompute: bool = False, tp: int = 1
                        ) -> tuple[float, float]:
        """(forward, backward) seconds of layers [first, last) for ``samples`` samples on one device of type t
        (in a tensor-parallel group of ``tp``)."""
        fwd_s, bwd_s, fwd_c, bwd_c = self.layer_times(t, tp)
        sl = slice(first, last)
        fwd = float(fwd_c[sl].sum()) + float(fwd_s[sl].sum()) * samples
        bwd = float(bwd_c[sl].sum()) + float(bwd_s[sl].sum()) * samples + (fwd if recompute else 0.0)
        return fwd, bwd

    def wgrad_prefix(self, t: str, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Cumulative (per-sample, per-call) weight-pass seconds over layers (layout of ``prefix``): each layer's
        weight-pass fraction (``DeviceCosts.split``: measured, else the analytic share) of its backward without
        its tensor-parallel all-reduces, which carry input gradients (a recomputed forward belongs to the
        input-gradient pass, which runs first)."""
        w_s, w_c, _, _ = self.devices[t].split
        return self._split_prefix(t, tp, w_s, w_c)

    def split_extra_prefix(self, t: str, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Cumulative (per-sample, per-call) seconds a split backward (zb-h1's and zb-v's B + W) takes beyond
        one backward (``DeviceCosts.split``; 0 where not measured)."""
        _, _, x_s, x_c = self.devices[t].split
        return self._split_prefix(t, tp, x_s, x_c)

    def _split_prefix(self, t: str, tp: int, ratio_s: np.ndarray, ratio_c: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
        comp_s, comp_c = backward_compute_s(self, t, tp)
        return (np.concatenate([[0.0], np.cumsum(comp_s * ratio_s)]),
                np.concatenate([[0.0], np.cumsum(comp_c * ratio_c)]))

    def stage_weight_grad_s(self, t: str, first: int, last: int, samples: float, tp: int = 1) -> float:
        """The weight pass of layers [first, last) for ``samples`` samples (``wgrad_prefix``)."""
        per_sample, per_call = self.wgrad_prefix(t, tp)
        return float(per_call[last] - per_call[first] + (per_sample[last] - per_sample[first]) * samples)

    def stage_split_extra_s(self, t: str, first: int, last: int, samples: float, tp: int = 1) -> float:
        """What splitting the backward of layers [first, last) adds to ``stage_compute_s``'s backward: a split
        stage's input pass takes backward - weight pass + this (``split_extra_prefix``)."""
        per_sample, per_call = self.split_extra_prefix(t, tp)
        return float(per_call[last] - per_call[first] + (per_sample[last] - per_sample[first]) * samples)

    def sample_s(self, t: str) -> float:
        """Seconds per sample for one device of type t running the whole model forward+backward (large batches:
        the fixed per-call part amortised away)."""
        return float(self.prefix(t)[-1])

    def upper_bound_samples_per_s(self, counts: Optional[dict[str, int]] = None) -> float:
        """Samples/s no plan can pass, under profiles too (``work_bound_samples_per_s``); one LP per device mix."""
        counts = counts or self.cluster.count_by_type()
        key, cache = tuple(sorted(counts.items())), self.__dict__.setdefault("_bound_cache", {})
        if key not in cache:
            cache[key] = work_bound_samples_per_s({t: np.diff(self.prefix(t)) for t in counts}, counts)
        return cache[key]

    # ---------------------------------------------------------------- memory
    def range_params(self, first, last, tp: int = 1):
        """Parameters one rank of a stage of layers [first, last) holds (in a tensor-parallel group of ``tp``:
        the blocks' split matrices divided tp ways). A tied embedding/head weight (``tie_embeddings``) is held
        by both its stages (memory on both, hethub.models.ties), and once when one stage has both ends.
        ``first``/``last`` may be arrays (the planner prices every layer range at once)."""
        cum = self._params_cum
        out = cum[last] - cum[first]
        if tp > 1:
            out = out - (self._split_cum[last] - self._split_cum[first]) * (1.0 - 1.0 / tp)
        if self.model.tie_embeddings:
            both = (np.asarray(first) == 0) & (np.asarray(last) == self.model.num_planner_layers)
            out = out - np.where(both, self._tied_params, 0.0)
        return out

    def tied_params(self, first, last):
        """Parameters of a tied weight this stage shares with another stage (0 when it holds both ends or none):
        their gradient is all-reduced over both stages' replicas every step. Arrays allowed."""
        if not self.model.tie_embeddings:
            return np.zeros_like(np.asarray(first, dtype=float)) if np.ndim(first) else 0.0
        one_end = (np.asarray(first) == 0) != (np.asarray(last) == self.model.num_planner_layers)
        out = np.where(one_end, self._tied_params, 0.0)
        return out if np.ndim(first) else float(out)

    def stage_params(self, first: int, last: int, tp: int = 1) -> float:
        return float(self.range_params(first, last, tp))

    def sharded(self, zero1: Optional[bool]) -> bool:
        """Whether a stage's optimizer state is sharded: plan-wide ZeRO-1 (``zero1`` here) or the stage's own."""
        return bool(self.zero1 or zero1)

    def optimizer_state_bytes(self, first: int, last: int, width: int = 1, tp: int = 1, zero1=None, whole=None):
        """Adam's state for layers [first, last) on one replica. With ZeRO-1 a replica of a stage of width w
        holds ceil(n / w) of the stage's n parameters' state (hethub.runtime.zero splits the flattened parameters
        element by element), so this is the figure a rank measures, not an average (``whole``: ``whole_state``)."""
        return float(self._optimizer_state_of(self.stage_params(first, last, tp), width, zero1, whole))

    def _optimizer_state_of(self, params, width: int, zero1: Optional[bool] = None, whole: Optional[tuple] = None):
        """``params`` a count or an array of counts (the planner prices many layer ranges at once); ``whole``:
        (whole parameters, ranks) where ZeRO-1 shards whole tensors (``whole_state``)."""
        params, width = whole if whole is not None and self.sharded(zero1) else (params, width)
        owned = np.ceil(np.asarray(params, dtype=float) / width) if self.sharded(zero1) and width > 1 else params
        return owned * ADAM_STATE_BYTES.get(self.dtype, ADAM_STATE_BYTES["bf16"])

    def state_bytes_of(self, params, width: int = 1, zero1: Optional[bool] = None, whole: Optional[tuple] = None):
        """Weights, gradients and optimizer state of ``params`` parameters on one replica of a stage of ``width``
        (``zero1``: the stage shards its optimizer state over its replicas; ``whole``: ``whole_state``)."""
        weights_grads = WEIGHT_GRAD_BYTES.get(self.dtype, WEIGHT_GRAD_BYTES["bf16"])
        return params * weights_grads + self._optimizer_state_of(params, width, zero1, whole)

    def state_bytes(self, first: int, last: int, width: int = 1, tp: int = 1, zero1=None, whole=None) -> float:
        """Weights, gradients and optimizer state of layers [first, last) on one rank of a replica."""
        return float(self.state_bytes_of(self.stage_params(first, last, tp), width, zero1, whole))

    def act_bytes(self, tp: int = 1) -> np.ndarray:
        """Per layer, per sample: bytes kept for backward without recompute on one rank of a tp group."""
        return self.layers.act_bytes - self.layers.act_split * (1.0 - 1.0 / tp)

    def wait_bytes(self, tp: int = 1) -> np.ndarray:
        """Per layer, per sample: bytes a layer whose backward is split holds between its input pass and its weight
        pass on one rank of a tp group (its whole graph, recomputed or not, plus ``LayerCosts.wait_extra``)."""
        share = np.where(self.layers.tp_split, 1.0 / tp, 1.0)
        return np.maximum(self.act_bytes(tp) + self.layers.wait_extra * share, 0.0)

    def memory_limit_bytes(self, t: str) -> float:
        return (self.cluster.device_type(t).memory_gib - self.memory_reserve_gib) * 2 ** 30

    # ---------------------------------------------------------------- links
    def _link_gbps(self, t_src: str, t_dst: str, same_host: bool) -> tuple[float, float]:
        """(Gbit/s, latency s) between two devices."""
        net = self.cluster.network
        if same_host:  # two types in one host (a workstation's two cards): the slower end's figure
            return min(net.intra_gbps(t_src), net.intra_gbps(t_dst)), net.intra_node_latency_us * 1e-6
        if self.cluster.device_type(t_src).vendor != self.cluster.device_type(t_dst).vendor:
            return self.cross_vendor_link()
        return net.inter_node_gbps, net.inter_node_latency_us * 1e-6

    def cross_vendor_link(self) -> tuple[float, float]:
        """(Gbit/s, latency s) of the host bridge between vendors: ``cross_vendor_gbps``, else the inter-node link."""
        net = self.cluster.network
        return net.cross_vendor_gbps or net.inter_node_gbps, net.inter_node_latency_us * 1e-6

    def wire_factor(self, dtype: Optional[str]) -> float:
        """Bytes on the wire of a boundary casting to ``dtype`` relative to the activations' own (None: no cast)."""
        return 1.0 if dtype is None else WIRE_BYTES[dtype] / self.element_bytes

    def link_s(self, nbytes, t_src: str, t_dst: Optional[str], same_host: bool):
        """Latency + wire time of ``nbytes`` (a number or the MILP's arrays), 0 where none; ``t_dst`` None: a vendor
        bridge."""
        gbps, lat = self.cross_vendor_link() if t_dst is None else self._link_gbps(t_src, t_dst, same_host)
        return np.where(np.asarray(nbytes) > 0, lat + np.asarray(nbytes) * 8 / (gbps * 1e9), 0.0)

    def p2p_s(self, nbytes: float, t_src: str, t_dst: str, same_host: bool) -> float:
        """Point-to-point transfer; across vendors add the device->host and host->device copies."""
        cross = self.cluster.device_type(t_src).vendor != self.cluster.device_type(t_dst).vendor
        return 0.0 if nbytes <= 0 else float(self.link_s(nbytes, t_src, t_dst, same_host) + (
            host_copies_s(nbytes) if cross else 0.0))

    def control_syncs_s(self, plan: Plan, train: bool = True) -> float:
        """The runtime's world-wide control all-reduce of an iteration: one, in training and in evaluation. In
        training it sums the loss every rank returns with the gradient norm each rank clips by and fp16's vote on
        finite gradients (``Gradients.step_sums``, at the step); in evaluation the loss alone, after the last
        action. A few numbers move, so only latency counts: a ring over every rank (the control channel),
        2 (n - 1) hops at the inter-node latency where the plan spans hosts, else the intra-node one.
        ``train`` is kept for the callers: both cost the same."""
        hosts = {rep.host for st in plan.stages for rep in st.replicas}
        net = self.cluster.network
        latency_s = (net.inter_node_latency_us if len(hosts) > 1 else net.intra_node_latency_us) * 1e-6
        return ring_allreduce(0.0, plan.world_size)[1] * latency_s

    def stage_sync_parts(self, plan: Plan, s: int) -> tuple[float, int, float]:
        """Stage s of a placed plan at the end of its backward: (its bucketed gradient all-reduce, the number of
        buckets, what runs after it: the ZeRO-1 all-gather and a tied weight's all-reduce over both stages'
        replicas). ``allreduce_end_s`` overlaps the first with the backward."""
        st, ranges = plan.stages[s], plan.stages[s].chunk_ranges  # a chunked group syncs all its chunks at once
        one_node = len({r.host for r in st.replicas}) == 1
        params, n = sum(self.range_params(a, b, _reduced_over(st)[0]) for a, b in ranges), _reduced_over(st)[1]
        ar = self._sync_s(params, st.types, n, one_node, False) if st.width > 1 else 0.0
        rest = self.sync_s(params, st.types, n, one_node, plan.shards_optimizer(st)) - ar
        tied = self.tied_params(min(a for a, _ in ranges), max(b for _, b in ranges))  # 0 if it holds both ends
        if tied:
            ends = [plan.stages[plan.pipeline[0].group], plan.stages[plan.pipeline[-1].group]]
            rest += self.tie_sync_s(tied, sorted({t for e in ends for t in e.types}), sum(e.width for e in ends))
        return float(ar), int(self.num_buckets(params)) if st.width > 1 else 1, float(rest)

    def stage_sync_s(self, plan: Plan, s: int, hide_s: float = 0.0) -> float:
        """Seconds stage s adds after a last gradient pass of ``hide_s`` seconds (``stage_sync_parts``)."""
        ar, n, rest = self.stage_sync_parts(plan, s)
        return float(allreduce_end_s(ar, n, [0.0], [hide_s])) + rest

    def num_buckets(self, params):
        """Buckets of ``bucket_mb`` MiB the runtime cuts ``params`` gradients into (at least one)."""
        nbytes = np.asarray(params, dtype=float) * self.grad_bytes
        return np.maximum(1.0, np.ceil(nbytes / (self.bucket_mb * 2 ** 20)))

    def tie_sync_s(self, tied_params, types: Sequence[str], ranks: int):
        """All-reduce of a tied weight's gradient over the ``ranks`` replicas of the two stages holding it
        (gradients of ``grad_bytes``, ring, inter-node link of the slowest type). ``tied_params`` may be an array."""
        if ranks <= 1:
            return np.zeros_like(np.asarray(tied_params, dtype=float)) if np.ndim(tied_params) else 0.0
        nbytes = np.asarray(tied_params, dtype=float) * self.grad_bytes
        volume, hops = ring_allreduce(nbytes, ranks)
        out = np.max([hops * lat + volume * 8 / (gbps * 1e9) for gbps, lat in (self._link_gbps(t, t, False)
                                                                            for t in types)], axis=0)
        out = np.where(nbytes > 0, out, 0.0)
        return out if np.ndim(tied_params) else float(out)

    def sync_s(self, params, types: Sequence[str], width: int, one_node: bool, zero1: Optional[bool] = None,
               hide_s=0.0):
        """A stage's synchronisation after its last backward: the gradient all-reduce (``grad_bytes`` each, in
        ``num_buckets`` buckets, each paying the ring's latency), less what a last gradient pass of ``hide_s``
        seconds hides of it (``allreduce_end_s``), and with ZeRO-1 the all-gather of the updated parameters (one
        more (w-1)/w of them, w-1 more hops, after the step: never hidden).

        Replicas of one vendor use the slowest of their types' links. A stage whose replicas span vendors
        goes through the host bridge (as hethub's runtime runs it): every buffer is copied device->host and
        back over PCIe, and the ring runs on the cross-vendor link. ``params`` and ``hide_s`` may be arrays.
        """
        if width <= 1:
            return np.zeros_like(np.asarray(params, dtype=float)) if np.ndim(params) else 0.0
        full = self._sync_s(params, types, width, one_node, self.sharded(zero1))
        if not np.any(np.asarray(hide_s) > 0):
            return full
        ar = self._sync_s(params, types, width, one_node, False)
        hides = np.asarray(hide_s, dtype=float)[..., None]
        out = full - ar + allreduce_end_s(ar, self.num_buckets(params), np.zeros_like(hides), hides)
        return out if np.ndim(out) else float(out)

    def _sync_s(self, params, types: Sequence[str], width: int, one_node: bool, gather: bool):
        """``sync_s`` with nothing hidden; ``gather``: with the ZeRO-1 all-gather."""
        nbytes = np.asarray(params, dtype=float) * self.grad_bytes
        (volume, hops), copies = ring_allreduce(nbytes, width), 2 * nbytes
        hops = hops * self.num_buckets(params)
        if gather:
            volume, hops, copies = volume + (width - 1) / width * nbytes, hops + width - 1, copies + 2 * nbytes
        vendors = {self.cluster.device_type(t).vendor for t in types}
        if len(vendors) > 1:
            gbps, lat = self.cross_vendor_link()
            out = hops * lat + volume * 8 / (gbps * 1e9) + copies / (PCIE_GBPS * 1e9)
        else:
            out = np.max([hops * lat + volume * 8 / (gbps * 1e9)
                          for gbps, lat in (self._link_gbps(t, t, one_node) for t in types)], axis=0)
        out = np.where(nbytes > 0, out, 0.0)
        return out if np.ndim(params) else float(out)

    def optimizer_s(self, t: str, first: int, last: int, width: int = 1, tp: int = 1, zero1=None, whole=None) -> float:
        """Optimizer step: memory-bound pass over this rank's state."""
        return float(self.optimizer_s_of(self.stage_params(first, last, tp), t, width, zero1, whole))

    def optimizer_s_of(self, params, t: str, width: int = 1, zero1: Optional[bool] = None, whole=None):
        """``optimizer_s`` for ``params`` parameters (a count or an array of counts)."""
        return (self.state_bytes_of(params, width, zero1, whole) * OPTIMIZER_PASSES
                / (self.cluster.device_type(t).memory_gbps * 1e9))


def whole_state(cm: CostModel, stage, first: int, last: int) -> Optional[tuple]:
    """The ``whole`` of ``CostModel.state_bytes_of`` for layers [first, last) of a placed stage: a stage mixing
    tensor-parallel degrees shards its ZeRO-1 state as whole tensors over every rank of it
    (``Stage.whole_state_ranks``); None for a stage of one degree."""
    return (cm.stage_params(first, last, 1), stage.whole_state_ranks) if stage.whole_state_ranks else None


def _reduced_over(st) -> tuple[int, int]:
    """(the degree a stage's reduced gradients are split by, the ranks that sum them): replicas of one degree
    reduce their shards, one group per shard; of different degrees, whole tensors over every rank of the stage
    (hethub.runtime.mixed_tp)."""
    return (st.tensor_parallel, st.width) if st.uniform_tp else (1, st.device_count)


def host_copies_s(nbytes):
    """A transfer between vendors' devices goes device -> host -> device: two PCIe copies of its bytes."""
    return 2 * np.asarray(nbytes) / (PCIE_GBPS * 1e9)


def peak_memory_bytes(state_bytes, activation_bytes, recompute_bytes, boundary_bytes):
    """A rank's peak: its state (weights, gradients, optimizer), the activations it holds at once, where it
    recomputes one layer's full activations rebuilt, and a boundary's send and receive buffers (two of the
    ``boundary_bytes`` a micro-batch's input takes). The planner's candidates solve it for the micro-batches that
    fit, the evaluator sums it along a group's order: one formula for both."""
    return state_bytes + activation_bytes + recompute_bytes + 2.0 * boundary_bytes


def measured_device_costs(cm: "CostModel", t: str, profiles: list[Profile], split) -> DeviceCosts:
    """A measured model has no analytic times: every layer of every device type comes from a profile of it."""
    n = cm.model.num_planner_layers
    if not profiles:
        raise InputError("--profiles", f"no profile of model {cm.model.name!r} on device type {t!r}: measure it "
                                       f"there (hethub profile --script SCRIPT --device-type {t} -o DIR), or plan "
                                       f"without that type")
    measured, fwd_m, bwd_m, fwd_a, bwd_a = measured_times(n, profiles)
    if not measured.all():
        raise InputError("--profiles", f"the profile of {t!r} lacks layers {_ranges(np.flatnonzero(~measured))} "
                                       f"of measured model {cm.model.name!r}")
    return DeviceCosts(fwd_m, bwd_m, cm.cluster.device_type(t).efficiency, measured, fwd_a, bwd_a, split)


def backward_compute_s(cm: "CostModel", t: str, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(per sample, per call) seconds of each layer's backward without its tensor-parallel all-reduces, the
    part a split backward shares out. A profile measured at this degree holds its all-reduces, which the
    link figure may overstate (Sailor's OPT-350M profiles of A100-40GB at TP 2 against its 14 Gbit/s intra-node
    figure: a block's backward less the all-reduces came out at -1.4 ms, and so did its weight pass); where
    it does, the layer's compute is the unsplit backward divided by the degree, at most the measured one."""
    _, bwd_s, _, bwd_c = cm.layer_times(t, tp)
    ar_s, ar_c = cm.tp_allreduce_s(t, tp)
    comp_s, comp_c = bwd_s - ar_s, bwd_c - ar_c
    if tp > 1 and ((comp_s < 0).any() or (comp_c < 0).any()):
        _, one_s, _, one_c = cm.layer_times(t, 1)
        split = cm.layers.tp_split
        div = np.where(split, float(tp), 1.0)
        comp_s = np.where(comp_s < 0, np.minimum(one_s / div, bwd_s), comp_s)
        comp_c = np.where(comp_c < 0, np.minimum(one_c / div, bwd_c), comp_c)
    return comp_s, comp_c


def pass_times_s(cm: CostModel, t: str, first: int, last: int, samples: float, recompute: bool, tp: int,
                 split: bool) -> tuple[float, float, float]:
    """(forward, backward, weight pass) seconds of layers [first, last) on type t: unsplit, the backward whole and
    no weight pass; split (zb-h1, zb-v), the input-gradient pass B and the weight pass W, together longer than
    one backward by the split's own cost. What the simulator replays and zb-v's order is timed by."""
    fwd, bwd = cm.stage_compute_s(t, first, last, samples, recompute, tp)
    if not split:
        return fwd, bwd, 0.0
    wgt = cm.stage_weight_grad_s(t, first, last, samples, tp)
    return fwd, bwd - wgt + cm.stage_split_extra_s(t, first, last, samples, tp), wgt


def usd_per_million_tokens(cm: CostModel, devices_by_type: dict[str, int], iteration_s: float, samples: int
                           ) -> Optional[float]:
    """Dollars per million tokens: the used devices' hourly prices over one iteration, per token it trains
    (``samples`` x sequence length). None when a used type has no ``usd_per_hour``."""
    prices = [cm.cluster.device_type(t).usd_per_hour for t in devices_by_type]
    if not devices_by_type or any(p is None for p in prices):
        return None
    usd = sum(p * n for p, n in zip(prices, devices_by_type.values())) * iteration_s / 3600.0
    return usd / (samples * cm.model.seq_length) * 1e6


def loss_saved_bytes(m: ModelConfig) -> float:
    """Per sample: what the language-model loss keeps for its backward, the log-probabilities of every position in
    fp32 (cross-entropy computes them in fp32 under autocast too). A measured model's last layer was measured
    with its loss."""
    return 0.0 if m.measured else 4.0 * m.seq_length * m.vocab_size


def with_measured_activations(layers: LayerCosts, profiles: Sequence[Profile], loss_bytes: float = 0.0
                              ) -> LayerCosts:
    """``layers`` with the activation bytes per sample that profiles measured (``hethub profile``: what autograd
    keeps for a layer's backward) in place of the analytic formula's, which counts a fused 16-bit block (a plain
    PyTorch block keeps about twice that). Per sample from an affine fit over the profiles' micro-batch sizes (a
    fixed part is not per sample), the largest over device types; a layer's tensor-parallel share scales with it.
    Profiles measured under tensor parallelism, or without activation bytes, change nothing. ``loss_bytes`` (per
    sample) is added to a measured head: a profile measures the head layer alone, not the loss after it."""
    points: dict[tuple[str, int], list[tuple[int, float]]] = {}
    waits: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for p in profiles:
        for lp in p.layers if p.tensor_parallel == 1 else ():
            if lp.activation_bytes:
                points.setdefault((p.device_type, lp.index), []).append((p.micro_batch_size, lp.activation_bytes))
                if lp.weight_pass_bytes is not None:
                    waits.setdefault((p.device_type, lp.index), []).append((p.micro_batch_size, lp.weight_pass_bytes))
    if not points:
        return layers
    per_sample: dict[int, float] = {}
    for (_t, idx), pts in points.items():
        per_sample[idx] = max(per_sample.get(idx, 0.0), _affine(pts)[1])
    wait = layers.wait_extra.copy()
    for idx in {i for _t, i in waits} & set(per_sample):  # the largest over device types, as the activations'
        if idx < len(wait):  # measured as one layer, the head's loss on neither side
            wait[idx] = max(_affine(pts)[1] for (_t, i), pts in waits.items() if i == idx) - per_sample[idx]
    act, split = layers.act_bytes.copy(), layers.act_split.copy()
    head = len(act) - 1
    if head in per_sample:  # a profile measures the head alone: the loss after it keeps more
        per_sample[head] += loss_bytes
    for idx, b in per_sample.items():
        if idx < len(act):
            split[idx] *= b / act[idx] if act[idx] > 0 else 0.0
            act[idx] = b
    return replace(layers, act_bytes=act, act_split=split, wait_extra=wait)


def measured_times(n: int, profiles: Sequence[Profile]) -> tuple[np.ndarray, ...]:
    """(measured mask, fwd per sample, bwd per sample, fwd per call, bwd per call) of every layer from the
    profiles of one (type, degree), for a model of n planner layers: an affine fit over micro-batch sizes
    where there are several."""
    measured = np.zeros(n, dtype=bool)
    samples_by_layer: dict[int, list[tuple[int, float, float]]] = {}
    for p in profiles:
        for lp in p.layers:
            samples_by_layer.setdefault(lp.index, []).append((p.micro_batch_size, lp.forward_ms / 1e3,
                                                              lp.backward_ms / 1e3))
            measured[lp.index] = True
    fwd_m, bwd_m, fwd_a, bwd_a = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    for idx, pts in samples_by_layer.items():
        (fwd_a[idx], fwd_m[idx]), (bwd_a[idx], bwd_m[idx]) = (_affine([(q[0], q[1]) for q in pts]),
                                                              _affine([(q[0], q[2]) for q in pts]))
    return measured, fwd_m, bwd_m, fwd_a, bwd_a


def split_ratios(share: np.ndarray, profiles: Sequence[Profile]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per layer: the weight pass as a fraction of the backward, per sample and per call, and the extra
    fraction the two passes of a split backward take beyond one backward (per sample, per call).

    Measured where a profile has both passes (affine fits over micro-batch sizes, as forward and backward
    are fitted); else ``share`` (the analytic ``LayerCosts.wgrad_share``) and no extra. Why measure: a split
    pays each pass's fixed costs (a second autograd call, the weight products run on their own), so on this
    CPU a block's two passes took 1.2-1.3x its backward and the weight pass 0.55-0.6x of it, not the
    analytic 0.45x; a zb-v iteration predicted with the analytic split was 20-27% short."""
    n = len(share)
    w_s, w_c, x_s, x_c = share.copy(), share.copy(), np.zeros(n), np.zeros(n)
    points: dict[int, list[tuple[int, float, float, float]]] = {}
    for p in profiles:
        for lp in p.layers:
            if lp.weight_grad_ms is not None and lp.input_grad_ms is not None:
                points.setdefault(lp.index, []).append((p.micro_batch_size, lp.backward_ms, lp.weight_grad_ms,
                                                        lp.input_grad_ms + lp.weight_grad_ms - lp.backward_ms))
    for idx, pts in points.items():
        (b_c, b_s), (wg_c, wg_s) = _affine([(q[0], q[1]) for q in pts]), _affine([(q[0], q[2]) for q in pts])
        extra = [(q[0], max(q[3], 0.0)) for q in pts]
        x_fit = _affine(extra) if any(v > 0 for _, v in extra) else (0.0, 0.0)
        w_s[idx], x_s[idx] = wg_s / b_s, x_fit[1] / b_s
        w_c[idx], x_c[idx] = (wg_c / b_c, x_fit[0] / b_c) if b_c > 0 else (w_s[idx], 0.0)
    return w_s, w_c, x_s, x_c


def _affine(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per-sample) seconds from (micro-batch size, seconds) points: least squares, fixed >= 0."""
    ns = sorted({n for n, _ in points})
    if len(ns) < 2:
        return 0.0, float(np.mean([t / n for n, t in points]))
    x = np.array([n for n, _ in points], dtype=float)
    y = np.array([t for _, t in points])
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:
        return 0.0, float(np.mean(y / x))
    return float(intercept), float(slope)


def calibrate_efficiency(model: ModelConfig, peak_tflops: float, measured_ms: dict[int, float],
                         micro_batch_size: int, flash_attention: bool = True) -> Optional[float]:
    """Achieved fraction of ``peak_tflops`` over the measured blocks and head (fwd+bwd): one factor per type."""
    costs = layer_costs(model, flash_attention)
    n = model.num_planner_layers
    idx = [i for i in measured_ms if 0 < i < n and measured_ms[i] > 0]  # compute-bound layers only
    if not idx:
        return None
    flops = sum(3.0 * costs.flops_fwd[i] for i in idx) * micro_batch_size
    seconds = sum(measured_ms[i] for i in idx) / 1e3
    return flops / seconds / (peak_tflops * 1e12)


def _shape(m: ModelConfig) -> str:
    if m.measured:
        return f"measured, {m.num_planner_layers} layers"
    return (f"{m.architecture}, {m.num_layers} layers, hidden {m.hidden_size}, ffn {m.ffn_hidden_size}, "
            f"heads {m.num_attention_heads}, vocab {m.vocab_size}, seq {m.seq_length}")


def _ranges(idx: Iterable[int]) -> str:
    idx = list(idx)
    out, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            out.append(f"{start}" if start == i else f"{start}..{i}")
            start = None
    return ", ".join(out)
