"""ZeRO stage 1 inside each stage: optimizer state sharded, element by element, over the replicas that
hold the same parameters.

Why hethub's own and not DeepSpeed's ZeRO-1 optimizer or ``torch.distributed.optim.ZeroRedundancyOptimizer``:
both assume the data-parallel group they are given is the whole story of a gradient, but under a hethub
plan a stage's gradient is summed within the stage (each replica's loss already carries its share of the
global batch), clipped by a norm over stages of unequal width, and stepped by the user's optimizer.
``ZeroRedundancyOptimizer`` also shards whole parameters, so a stage holding an embedding table and one
block cannot split its state evenly. So the stage keeps its exact all-reduce and global-norm clipping,
and ZeRO-1 is only what remains, as DeepSpeed's stage 1 does it:

- each of the optimizer's parameter groups is flattened (the stage's parameters in group order); replica
  j of a stage of width w owns elements [j c, (j+1) c) with c = ceil(n / w), held as one flat parameter
  (``FlatShard.shard``) that replaces the group's parameters in the optimizer. Optimizer state is
  therefore ceil(n / w) elements per replica: the figure ``CostModel.optimizer_state_bytes`` charges;
- after the stage's gradient all-reduce, each replica copies its elements of the gradient into its
  shard (clipping scales both), the optimizer steps the shard, and an all-gather of the padded shards
  writes every updated parameter back on every replica.

A stage whose replicas differ in tensor parallelism (``hethub.runtime.mixed_tp``) has no "ranks holding the same
shard": its shards do not align. There ZeRO-1 shards the *whole* tensors instead, over every rank of the stage:
rank j of the stage's n ranks owns elements [j c, (j+1) c) of the group's whole parameters flattened, c = ceil(N / n)
(N whole elements); it takes them from the whole gradient sums the stage's all-reduce already built, refreshes them
from the whole parameters (a gather within its own tensor-parallel group), and after the step writes back its own
shard of the gathered whole tensors. Same element-wise update, so the same exactness.

Optimizers whose update of an element depends only on that element (SGD, Adam, AdamW, RMSprop, ...)
train exactly as without ZeRO-1. Ones with per-tensor statistics (LAMB, Adafactor) would see one flat
tensor: that is said in the README, as DeepSpeed's ZeRO says it. Checkpoints all-gather the state back into
per-layer, per-parameter tensors, so they load with or without ZeRO-1 under any plan.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from .mixed_tp import whole_shape
from .tp import full, is_sharded, local, shard_of


class FlatShard:
    """One parameter group of one replica (or, ``whole``, of one rank of a stage mixing tensor-parallel degrees):
    which elements it owns and the flat parameter that holds them."""

    def __init__(self, params: Sequence[torch.nn.Parameter], replica: int, width: int, whole: bool = False):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"optimizer.param_groups: ZeRO-1 flattens each group into one tensor; a group mixes "
                             f"dtypes {sorted(map(str, dtypes))}: put each dtype in its own group")
        self.params = list(params)
        self.whole = whole
        # the element space: this rank's shard of each tensor-parallel parameter, or (whole) the whole tensors
        self.shapes = [whole_shape(p) if whole else tuple(local(p).shape) for p in self.params]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.total = sum(self.sizes)
        self.width = width
        self.chunk = math.ceil(self.total / width) if self.total else 0
        self.start = min(replica * self.chunk, self.total)
        self.stop = min(self.start + self.chunk, self.total)
        first = self.params[0]
        flat = torch.cat([v.reshape(-1) for v in self._values()])[self.start:self.stop]
        self.shard = torch.nn.Parameter(flat.clone().to(first.device), requires_grad=True)

    def _values(self) -> list[torch.Tensor]:
        """The parameters in the element space (whole: gathered within the replica's tensor-parallel group, so every
        rank of the stage calls this at the same point)."""
        with torch.no_grad():
            return [(full(p) if self.whole else local(p)).detach() for p in self.params]

    def _pieces(self):
        """(parameter index, first element in the parameter, first element in the shard, count) for owned elements."""
        offset = 0
        for i, n in enumerate(self.sizes):
            a, b = max(offset, self.start), min(offset + n, self.stop)
            if a < b:
                yield i, a - offset, a - self.start, b - a
            offset += n

    def _grad(self, i: int, sums: dict) -> Optional[torch.Tensor]:
        """Parameter i's reduced gradient in the element space (whole: a split parameter's whole sum, ``sums``)."""
        p = self.params[i]
        if self.whole and is_sharded(p):
            return sums[id(p)]
        return local(p.grad) if p.grad is not None else None

    def load_grads(self, sums: Optional[dict] = None) -> None:
        """This replica's elements of the (already reduced) gradient into the shard's gradient, and of the
        parameters into the shard (they may have changed since the last step: a checkpoint loaded, a user's
        edit), so the step always starts from the parameters the model holds. ``sums``: see ``_grad``."""
        g = torch.zeros_like(self.shard)
        values = self._values()
        with torch.no_grad():
            for i, src, dst, n in self._pieces():
                self.shard[dst:dst + n].copy_(values[i].reshape(-1)[src:src + n])
                grad = self._grad(i, sums or {})
                if grad is not None:
                    g[dst:dst + n].copy_(grad.detach().reshape(-1)[src:src + n])
        self.shard.grad = g

    def padded(self) -> torch.Tensor:
        """The shard padded to ``chunk`` elements (every replica's all-gather input has one size)."""
        out = torch.zeros(self.chunk, dtype=self.shard.dtype, device=self.shard.device)
        out[:self.stop - self.start].copy_(self.shard.detach())
        return out

    def write_back(self, full: torch.Tensor) -> None:
        """Every parameter from the gathered flat buffer (replica order = element order); whole: this rank's shard
        of each whole tensor."""
        offset = 0
        with torch.no_grad():
            for p, n, shape in zip(self.params, self.sizes, self.shapes):
                piece = full[offset:offset + n].view(shape)
                local(p).copy_(shard_of(piece, p) if self.whole else piece)
                offset += n

    # --- checkpoints: per-parameter state <-> this replica's flat state
    def split_state(self, gathered: dict[str, torch.Tensor], scalars: dict) -> list[dict]:
        """Per parameter state from full flat state tensors (``gathered``) and per-group scalars (step), shaped as the
        element space (whole: whole tensors)."""
        out, offset = [], 0
        for n, shape in zip(self.sizes, self.shapes):
            st = {k: v[offset:offset + n].reshape(shape).clone() for k, v in gathered.items()}
            st.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
            out.append(st)
            offset += n
        return out

    def join_state(self, per_param: Sequence[dict]) -> dict:
        """This replica's flat state from full per-parameter states in the element space (all present, same keys)."""
        first = per_param[0]
        state = {}
        for k, v in first.items():
            if torch.is_tensor(v) and v.dim() > 0:
                flat = torch.cat([st[k].reshape(-1) for st in per_param])[self.start:self.stop]
                state[k] = flat.to(self.shard.device, self.shard.dtype if v.is_floating_point() else v.dtype).clone()
            else:
                state[k] = v.clone() if torch.is_tensor(v) else v
        return state


class Zero1:
    """ZeRO-1 of one replica: its optimizer's groups replaced by flat shards (see the module docstring).
    ``replica`` of ``width``: this replica's place among the stage's; ``whole``: a stage mixing tensor-parallel
    degrees, where they are this rank's place among every rank of the stage."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], replica: int,
                 width: int, whole: bool = False):
        if optimizer.state:
            raise ValueError("optimizer: ZeRO-1 shards the optimizer before its first step; this one already "
                             "holds state (load state with engine.load_checkpoint after hethub.initialize)")
        mine = {id(p) for p in params}
        self.shards: list[FlatShard] = []
        for group in optimizer.param_groups:
            ps = [p for p in group["params"] if id(p) in mine]
            if not ps:
                group["params"] = []
                continue
            shard = FlatShard(ps, replica, width, whole)
            self.shards.append(shard)
            group["params"] = [shard.shard]

    def load_grads(self, sums: Optional[dict] = None) -> None:
        """``sums``: a stage mixing degrees, the whole gradient sums of its split parameters (``mixed_tp``)."""
        for s in self.shards:
            s.load_grads(sums)

    def shard_grads(self) -> list[torch.Tensor]:
        return [s.shard.grad for s in self.shards if s.shard.grad is not None]

    def gather_parameters(self, all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the step: every replica's updated elements to every replica (``all_gather`` concatenates
        the padded shards of the stage's replicas in replica order)."""
        for s in self.shards:
            if s.total:
                s.write_back(all_gather(s.padded()))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state on this rank (what ZeRO-1 divides)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v))
