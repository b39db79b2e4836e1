"""Gradients and the other collectives over a stage's replicas: data-parallel and tied-weight reduction, the
global gradient norm, the ZeRO-1 gather, and the loss every rank returns.

Scaling is exact by construction: each replica's loss is its per-sample mean times ``samples / global_batch``,
so a SUM over a stage's replicas is the gradient of the global mean loss (never an average). A stage whose
replicas span vendors reduces through the host bridge (its gloo group, on host buffers), like a cross-vendor
boundary. Scalars (the norm, the loss) go over the control channel (``control``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..partitioner.costmodel import DEFAULT_BUCKET_MB
from . import mixed_tp, precision
from .buckets import maybe_buckets
from .control import Control
from .errors import Guard
from .tp import is_sharded, local


BUCKET_BYTES = int(DEFAULT_BUCKET_MB * 2**20)


class Gradients:
    """One rank's share of the step's collectives. ``zero1`` is this replica's ``hethub.runtime.zero.Zero1`` (or None)."""

    def __init__(self, grid, module, device: torch.device, guard: Guard, control: Control, zero1=None,
                 bucket_bytes: int = BUCKET_BYTES):
        self.grid, self.module, self.device, self.guard, self.zero1 = grid, module, device, guard, zero1
        self.control = control
        layers = dict(module.indexed_layers())
        self.tied = [(tie, group, _tied_parameter(tie, layers)) for tie, group in grid.tie_groups]
        self.global_norm: Optional[float] = None  # of the last clip
        self._sums: Optional[tuple] = None  # (loss, squared norm, all finite, scale in it) of this step (step_sums)
        group = grid.get_data_parallel_group() if grid.data_parallel_size > 1 else None
        # a stage mixing tensor-parallel degrees sums whole-size gradients at the end instead (mixed_tp)
        self.buckets = None if grid.mixed_tp else maybe_buckets(
            module.parameters(), bucket_bytes, group, group is not None and grid.on_host(group) and device.type != "cpu",
            grid.data_parallel_size, self._guarded_stage_call)

    def _guarded_stage_call(self, fn: Callable, what: str):
        self.guard.peers = tuple(self.grid.dp_ranks)
        return self.guard(fn, what)

    def start_iteration(self) -> None:
        """Before a training iteration's first backward (``hethub.runtime.buckets``)."""
        if self.buckets is not None:
            self.buckets.prepare()

    def arm(self, params: frozenset) -> None:
        """An action that finishes the iteration's gradients of ``params`` (ids) starts (empty: it ended): buckets
        start as their gradients complete."""
        if self.buckets is not None:
            self.buckets.arm(params)

    def ready(self, params) -> None:
        """zb-h1's weight pass just accumulated ``params``' gradients (autograd's own accumulation hooks itself)."""
        if self.buckets is not None:
            self.buckets.ready(params)

    def reduce(self) -> None:
        """SUM within the stage's replicas (what the buckets did not finish during the backward), then across the
        stages holding a tied weight; ZeRO-1 takes its shard."""
        sums = None
        if self.buckets is not None:
            self.buckets.finish()
        elif self.grid.mixed_tp:
            params = [p for p in self.module.parameters() if p.requires_grad]
            sums = mixed_tp.reduce_whole(params, self.grid.tp_rank, lambda flat: self._stage_collective(
                _summed, flat, "the gradient all-reduce (replicas of different tensor-parallel degrees)"))
        self._reduce_tied()
        if self.zero1 is not None:
            self.zero1.load_grads(sums)

    def _stage_collective(self, fn: Callable, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Run a collective over the stage's replicas (through the host bridge where they span vendors)."""
        self.guard.peers = tuple(self.grid.dp_ranks)
        group = self.grid.get_data_parallel_group()
        if not self.grid.on_host(group) or tensor.device.type == "cpu":
            return self.guard(lambda: fn(tensor, group), what)
        host = tensor.to("cpu")
        out = self.guard(lambda: fn(host, group), what + " (host bridge)")
        return out.to(tensor.device)

    def _reduce_tied(self) -> None:
        """A weight tied across stages: replica 0 of each holding stage gives its stage's (already reduced)
        gradient, the others zeros; the sum over every holder is the single-process gradient (hethub.models.ties)."""
        for _tie, group, p in self.tied:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            first = self.grid.replica_id == 0 and self.grid.tp_rank == 0  # one contribution per stage
            mine = g.detach().clone() if first else torch.zeros_like(g)
            self.guard.peers = tuple(dist.get_process_group_ranks(group))
            bridged = self.grid.on_host(group) and mine.device.type != "cpu"  # the tie spans vendors
            wire = mine.cpu() if bridged else mine
            self.guard(lambda: dist.all_reduce(wire, group=group), "the tied-weight all-reduce")
            p.grad = wire.to(mine.device) if bridged else mine

    def _norm_parameters(self) -> list:
        """Parameters whose gradients this stage counts in the global norm: a tied weight only on its owner's
        stage."""
        skip = {id(p) for tie, _group, p in self.tied
                if not any(a <= tie.owner[0] < b for a, b in self.grid.stage.chunk_ranges)}
        return [p for p in self.module.parameters() if p.grad is not None and id(p) not in skip]

    def step_sums(self, total_loss: Optional[torch.Tensor], scale: Optional[float]) -> None:
        """At the optimizer step, before it: this rank's share of the loss, its share of the squared gradient norm
        and its vote on finite gradients, summed over the world in one control all-reduce (three latency-bound
        rings per step were one each). Norms come from ``torch._foreach_norm`` (one kernel per dtype, one device
        sync for the three numbers). ``scale``: fp16's loss scale the gradients still carry (a power of two: the
        norm of the unscaled gradients is exactly this one divided by it)."""
        grads = [local(p.grad) for p in self.module.parameters() if p.grad is not None]
        counted = {id(local(p.grad)) for p in self._norm_parameters() if is_sharded(p) or self.grid.tp_rank == 0}
        shards = self.zero1.shard_grads() if self.zero1 is not None else []
        mine = torch.zeros(3, dtype=torch.float64)
        if self.grid.holds_last and self.grid.tp_rank == 0 and total_loss is not None:
            mine[0] = total_loss.detach().double().reshape(())
        picked = [i for i, g in enumerate(grads) if id(g) in counted] if self.grid.replica_id == 0 else []
        mine[1:] = precision.norm_and_vote(grads + shards, picked)
        self.guard.peers = ()
        total = self.guard(lambda: self.control.sum(mine), "the step's all-reduce (loss, gradient norm, fp16 vote)")
        self._sums = (total[0], float(total[1]), float(total[2]) == 0.0, scale or 1.0)

    def clip(self, max_norm: float) -> float:
        """Clip by the global norm (``step_sums``): each stage's squared norm once (replica 0 contributes), summed
        over stages; in a tensor-parallel group a split parameter's shards add up on every rank, a whole one
        counts once."""
        _loss, sq, _finite, scale = self._sums
        total = sq ** 0.5 / scale
        self.global_norm = total
        coef = max_norm / (total + 1e-6)
        grads = [local(p.grad) for p in self.module.parameters() if p.grad is not None]
        grads += self.zero1.shard_grads() if self.zero1 is not None else []
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        return total

    def unscale(self, scale: float) -> bool:
        """fp16: divide the step's gradients by the loss scale; True when every rank's are finite (the vote of
        ``step_sums``, so that every rank skips the same steps and the stages never diverge)."""
        grads = [local(p.grad) for p in self.module.parameters() if p.grad is not None]
        shards = self.zero1.shard_grads() if self.zero1 is not None else []
        precision.unscale(grads + shards, scale)
        return self._sums[2]  # (the norm step_sums summed is of the scaled gradients: clip divides it by the scale)

    def after_step(self) -> None:
        """ZeRO-1: every replica gathers the updated parameters from the shards."""
        if self.zero1 is not None:
            self.zero1.gather_parameters(self.all_gather_stage)

    def all_gather_stage(self, t: torch.Tensor, what: str = "the ZeRO-1 all-gather") -> torch.Tensor:
        """Concatenation of ``t`` (one size everywhere) over the stage's replicas, in replica order (a stage mixing
        tensor-parallel degrees: over every rank of it, in its group's order)."""
        def gather(x, group):
            parts = [torch.empty_like(x) for _ in range(len(self.grid.dp_ranks))]
            dist.all_gather(parts, x, group=group)
            return torch.cat(parts)
        return self._stage_collective(gather, t, what)

    def global_loss(self, total_loss: Optional[torch.Tensor]) -> torch.Tensor:
        """Sum of every replica's sample-weighted loss (already divided by the batch), on every rank: the last
        stage's replicas (their tensor-parallel leads) give theirs, every other rank 0, over the control channel
        in float64 (no rounding on the way)."""
        if self._sums is not None:  # a training step summed its loss with the norm and the vote
            loss, self._sums = self._sums[0], None
            return loss.to(self.device)
        grid = self.grid
        self.guard.peers = ()
        with torch.no_grad():
            mine = torch.zeros(1, dtype=torch.float64)
            if grid.holds_last and grid.tp_rank == 0:
                mine = total_loss.detach().double().reshape(1).cpu()
            loss = self.guard(lambda: self.control.sum(mine), "loss broadcast")
        return loss[0].to(self.device)


def broadcast_weights(grid, params: list) -> None:
    """Every replica of the stage starts from replica 0's weights, each rank's own shard from the rank holding the
    same shard (a stage mixing degrees: from replica 0's whole tensors, ``mixed_tp``); through the host bridge where
    the stage spans vendors."""
    if grid.data_parallel_size == 1:
        return
    group = grid.get_data_parallel_group()

    def broadcast(data: torch.Tensor, src: int) -> None:
        bridged = grid.on_host(group) and data.device.type != "cpu"
        wire = data.cpu() if bridged else data
        dist.broadcast(wire, src=src, group=group)
        if bridged:
            data.copy_(wire)
    if grid.mixed_tp:
        mixed_tp.broadcast_whole(params, grid.stage.replicas[0].rank, broadcast)
        return
    for p in params:
        broadcast(local(p).data, grid.dp_ranks[0])


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def _tied_parameter(tie, layers: dict):
    """This stage's Parameter of a tie (any of its local places: they are one object)."""
    idx, name = next((i, n) for i, n in tie.places if i in layers)
    return dict(layers[idx].named_parameters())[name]
