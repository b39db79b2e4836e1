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

Optimizers whose update of an element depends only on that element (SGD, Adam, AdamW, RMSprop, ...)
train exactly as without ZeRO-1. Ones with per-tensor statistics (LAMB, Adafactor) would see one flat
tensor: that is said in the README, as DeepSpeed's ZeRO says it. Checkpoints all-gather the state back into
per-layer, per-parameter tensors, so they load with or without ZeRO-1 under any plan.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .tp import local


class FlatShard:
    """One parameter group of one replica: which elements it owns and the flat parameter that holds them."""

    def __init__(self, params: Sequence[torch.nn.Parameter], replica: int, width: int):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"optimizer.param_groups: ZeRO-1 flattens each group into one tensor; a group mixes "
                             f"dtypes {sorted(map(str, dtypes))}: put each dtype in its own group")
        self.params = list(params)
        self.sizes = [local(p).numel() for p in self.params]  # tensor-parallel: this rank's shard
        self.total = sum(self.sizes)
        self.width = width
        self.chunk = math.ceil(self.total / width) if self.total else 0
        self.start = min(replica * self.chunk, self.total)
        self.stop = min(self.start + self.chunk, self.total)
        first = self.params[0]
        flat = torch.cat([local(p).detach().reshape(-1) for p in self.params])[self.start:self.stop]
        self.shard = torch.nn.Parameter(flat.clone().to(first.device), requires_grad=True)

    def _pieces(self):
        """(parameter, first element in the parameter, first element in the shard, count) for owned elements."""
        offset = 0
        for p, n in zip(self.params, self.sizes):
            a, b = max(offset, self.start), min(offset + n, self.stop)
            if a < b:
                yield p, a - offset, a - self.start, b - a
            offset += n

    def load_grads(self) -> None:
        """This replica's elements of the (already reduced) gradient into the shard's gradient, and of the
        parameters into the shard (they may have changed since the last step: a checkpoint loaded, a user's
        edit), so the step always starts from the parameters the model holds."""
        g = torch.zeros_like(self.shard)
        with torch.no_grad():
            for p, src, dst, n in self._pieces():
                self.shard[dst:dst + n].copy_(local(p).detach().reshape(-1)[src:src + n])
                if p.grad is not None:
                    g[dst:dst + n].copy_(local(p.grad).detach().reshape(-1)[src:src + n])
        self.shard.grad = g

    def padded(self) -> torch.Tensor:
        """The shard padded to ``chunk`` elements (every replica's all-gather input has one size)."""
        out = torch.zeros(self.chunk, dtype=self.shard.dtype, device=self.shard.device)
        out[:self.stop - self.start].copy_(self.shard.detach())
        return out

    def write_back(self, full: torch.Tensor) -> None:
        """Every parameter from the gathered flat buffer (replica order = element order)."""
        offset = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.sizes):
                mine = local(p)
                mine.copy_(full[offset:offset + n].view_as(mine))
                offset += n

    # --- checkpoints: per-parameter state <-> this replica's flat state
    def split_state(self, gathered: dict[str, torch.Tensor], scalars: dict) -> list[dict]:
        """Per parameter state from full flat state tensors (``gathered``) and per-group scalars (step)."""
        out, offset = [], 0
        for p, n in zip(self.params, self.sizes):
            st = {k: v[offset:offset + n].reshape(local(p).shape).clone() for k, v in gathered.items()}
            st.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
            out.append(st)
            offset += n
        return out

    def join_state(self, per_param: Sequence[dict]) -> dict:
        """This replica's flat state from full per-parameter states (all present, same keys)."""
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
    """ZeRO-1 of one replica: its optimizer's groups replaced by flat shards (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], replica: int,
                 width: int):
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
            shard = FlatShard(ps, replica, width)
            self.shards.append(shard)
            group["params"] = [shard.shard]

    def load_grads(self) -> None:
        for s in self.shards:
            s.load_grads()

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
