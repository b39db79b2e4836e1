"""The control channel: every small message that is not training data goes over one gloo group, on host tensors.

Why one rule in one place: checks and agreements (the plan and version check, a checkpoint's verdicts and step),
the loss every rank returns, the gradient norm and the exit barrier are a few numbers each. On GPUs the world group
is NCCL, which takes no host tensors, and on a plan that spans vendors no NCCL/RCCL group may span the world at
all. gloo on host tensors works in both, costs microseconds at these sizes, and never interleaves with the
boundary traffic whose order NCCL fixes.
"""
from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist


class Control:
    """Collectives over the whole world on host tensors. Build right after ``torch.distributed`` is initialised
    (every rank, before any other group: creating it is collective)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s  # the run's bound on waiting for a peer (hetero.timeout_s)
        # a gloo world is its own control channel; on NCCL a gloo group over every rank
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64, the same length everywhere), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return [t.tolist() for t in every]

    def min(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum over every rank (int64)."""
        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over every rank of a float64 tensor (moved to the host and back to its device)."""
        host = value.detach().to("cpu", torch.float64)
        dist.all_reduce(host, group=self.group)
        return host.to(value.device)

    def barrier(self, timeout_s: float) -> None:
        """Every rank reached here within ``timeout_s`` (raises RuntimeError naming who did not)."""
        dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast_text(self, text: str, src: int = 0) -> str:
        """``text`` of rank ``src`` on every rank (the others' argument is ignored): its length, then its bytes."""
        data = text.encode() if self.rank == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src=src, group=self.group)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src and data
               else torch.zeros(int(n), dtype=torch.uint8))
        if int(n):
            dist.broadcast(buf, src=src, group=self.group)
        return buf.numpy().tobytes().decode()
