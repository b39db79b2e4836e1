"""A stage whose replicas differ in tensor parallelism (an A100 at TP 1 beside V100s at TP 2 or 3, same layers).

Why whole-size sums: a replica of degree t holds 1/t of each split matrix, cut where its own degree cuts it, so
the shards of replicas of different degrees do not align (halves beside thirds) and no group of "the ranks
holding the same shard" exists. Each rank instead lays its gradient shard into a zero tensor of the whole
parameter's shape (a replicated parameter: the group's lead gives it, the others zeros), one SUM over every rank of
the stage adds each replica's whole gradient exactly once, and each rank keeps its own shard of the sum. Adding
zeros is exact, so the result is the single-process gradient, as in a stage of one degree. It moves whole-size
tensors (the planner prices that: ``CostModel.stage_sync_parts``); the start-up weight broadcast works the same
way, from replica 0's whole tensors.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .tp import from_local, full, is_dtensor, is_sharded, local, place_shard, shard_of, split_of


def whole_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's whole shape (a DTensor's own; a marked shard's times its group's size along its dim)."""
    split = split_of(p)
    if split is None:
        return tuple(p.shape)
    shape = list(p.shape)
    shape[split.dim] *= dist.get_world_size(split.group)
    return tuple(shape)


def reduce_whole(params: list, tp_rank: int, collective: Callable[[torch.Tensor], torch.Tensor]
                 ) -> dict[int, torch.Tensor]:
    """SUM every parameter's whole gradient over the stage (``collective``: an all-reduce over every rank of it,
    returning the sum) and keep this rank's shard. ``params``: the stage's trainable parameters, in the same order on
    every rank. Returns the whole sums of the split parameters (by ``id``): ZeRO-1 over the stage steps elements of
    whole tensors (``hethub.runtime.zero``), which this rank's shard alone does not hold."""
    sums: dict[int, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        grad = local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
        by_dtype.setdefault(grad.dtype, []).append((p, grad))
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        pairs = by_dtype[dtype]
        wholes = []
        for p, grad in pairs:
            whole = torch.zeros(whole_shape(p), dtype=dtype, device=grad.device)
            if is_sharded(p):
                place_shard(whole, grad, p)
            elif tp_rank == 0:  # a replicated parameter: one contribution per replica
                whole.copy_(grad)
            wholes.append(whole)
        summed = collective(torch.cat([w.reshape(-1) for w in wholes]))
        offset = 0
        for (p, grad), whole in zip(pairs, wholes):
            n = whole.numel()
            piece = summed[offset:offset + n].view(whole.shape)
            offset += n
            mine = piece
            if is_sharded(p):
                mine, sums[id(p)] = shard_of(piece, p), piece
            if p.grad is None:
                p.grad = _as_grad(p, mine)
            else:
                local(p.grad).copy_(mine)
    return sums


def _as_grad(p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """A gradient for ``p`` holding ``part`` (a DTensor parameter takes a DTensor gradient laid out as it is)."""
    part = part.clone()
    return from_local(part, p) if is_dtensor(p) else part


def broadcast_whole(params: list, src: int, broadcast: Callable[[torch.Tensor, int], None]) -> None:
    """Every rank of the stage takes replica 0's weights: each replica gathers its whole tensors (collective within
    its own tensor-parallel group), ``src`` (replica 0's lead) broadcasts them, each rank keeps its shard."""
    for p in params:
        whole = full(p).detach().clone()
        broadcast(whole, src)
        with torch.no_grad():
            local(p).copy_(shard_of(whole, p) if is_sharded(p) else whole)
