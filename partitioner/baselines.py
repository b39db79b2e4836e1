"""Baselines, predicted with the same cost model so comparisons are fair.

- ``uniform`` / ``parameters``: DeepSpeed's own ``PipelineModule`` partition methods
  (``partition_method="uniform"``: equal layer counts; ``"parameters"``: balanced parameter counts)
  over *all* devices, with equal widths and equal sample splits, ranks in hostfile order (stage s
  gets ranks [s*w, (s+1)*w), as ``PipeDataParallelTopology`` does). Stage counts whose stages would
  straddle two device types are skipped: a plan's stage runs on one device type.
- ``fastest-only``: the planner itself, restricted to the fastest device type.
"""
from __future__ import annotations

import itertools

import math
from typing import Sequence

from .costmodel import CostModel
from .errors import InfeasibleError
from .evaluate import choose_by_simulation, fits_memory
from .placement import StageLayout, build_plan, even_split
from .records import Plan

# DeepSpeed's own partition methods, equal widths over every device; "fastest-only": hethub's planner on the
# fastest type's devices alone (``api.make_baseline``).
DEEPSPEED_METHODS = ("uniform", "parameters")
BASELINES = (*DEEPSPEED_METHODS, "fastest-only")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform``: boundaries of equal parts (the first ones take the remainder)."""
    return [0, *itertools.accumulate(even_split(num_items, num_parts))]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous partition minimising the heaviest part (DeepSpeed's ``parameters`` balances this way)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # dp[p][i]: best max-part weight splitting items [0, i) into p parts
    INF = math.inf
    dp = [[INF] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    dp[0][0] = 0.0
    for p in range(1, num_parts + 1):
        for i in range(p, n + 1):
            for k in range(p - 1, i):
                v = max(dp[p - 1][k], prefix[i] - prefix[k])
                if v < dp[p][i]:
                    dp[p][i], cut[p][i] = v, k
    bounds, i = [n], n
    for p in range(num_parts, 0, -1):
        i = cut[p][i]
        bounds.append(i)
    return bounds[::-1]


def deepspeed_baseline(cm: CostModel, global_batch: int, method: str) -> Plan:
    """Best (stage count, micro-batch size) for DeepSpeed's partition over all devices, equal widths/splits."""
    cluster = cm.cluster
    devices = [n.device_type for n in cluster.nodes for _ in range(n.count)]
    N, L = len(devices), cm.model.num_planner_layers
    feasible: list[Plan] = []
    for S in range(1, min(N, L) + 1):
        if N % S:
            continue
        w = N // S
        types = [devices[s * w:(s + 1) * w] for s in range(S)]
        if any(len(set(t)) > 1 for t in types):
            continue
        if method == "uniform":
            bounds = partition_uniform(L, S)
        elif method == "parameters":
            bounds = partition_balanced(list(cm.layers.params), S)
        else:
            raise ValueError(f"unknown partition method {method!r}")
        for b in range(w, global_batch + 1, w):
            if global_batch % b:
                continue
            layouts = [StageLayout((bounds[s], bounds[s + 1]), types[s][0], even_split(b, w)) for s in range(S)]
            plan = build_plan(cm.model, cluster, layouts, b, global_batch // b, dtype=cm.dtype)
            if not fits_memory(plan, cm):
                # a replica's peak grows with b (its rows times the micro-batches in flight, min(M, S - s), is
                # min(G, b (S - s)) / w): no larger micro-batch fits either. On 768 devices building and
                # checking every size took 3.7 s of `plan`'s comparisons.
                break
            feasible.append(plan)
    if not feasible:
        raise InfeasibleError("--baseline", f"DeepSpeed's {method!r} partition over all {N} devices fits no stage "
                                            f"count and micro-batch size (memory, or stages straddling device types)")
    return choose_by_simulation(feasible, cm)
