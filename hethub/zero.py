"""ZeRO stage 1 inside each stage: optimizer state sharded over the replicas that hold the same parameters.

Why hethub's own and not DeepSpeed's ZeRO-1 optimizer or ``torch.distributed.optim.ZeroRedundancyOptimizer``:
both assume the data-parallel group they are given is the whole story of a gradient, but under a hethub
plan a stage's gradient is summed within the stage (each replica's loss already carries its share of the
global batch), clipped by a norm over stages of unequal width, and stepped by the user's optimizer. So
the stage keeps its exact all-reduce and global-norm clipping, and ZeRO-1 is only what remains:

- each parameter is owned by one replica of its stage (largest parameters first, each to the replica
  with the fewest elements so far: the same answer on every replica), and that replica's optimizer
  holds only the parameters it owns, so optimizer state (Adam's two moments) is split about 1/width;
- after the step, each owner broadcasts its updated parameters to the stage's other replicas.

The arithmetic of every parameter's update is unchanged, so a ZeRO-1 run trains exactly like one
without it. Checkpoints gather the owners' state into the per-layer files, so they load with or
without ZeRO-1 under any plan.
"""
from __future__ import annotations

from typing import Sequence

import torch


def shard_owners(params: Sequence[torch.Tensor], width: int) -> list[int]:
    """Owner replica (0..width-1) of each parameter, balanced by element count."""
    loads = [0] * width
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        j = min(range(width), key=lambda r: (loads[r], r))
        owners[i] = j
        loads[j] += params[i].numel()
    return owners


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state on this rank (what ZeRO-1 divides)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v))
