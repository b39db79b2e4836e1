"""A stage's data-parallel gradient all-reduce, bucketed, in place, and started while the backward still runs.

Why: one all-reduce of one flat copy after the last backward costs a second copy of every gradient and leaves
the whole reduction on the critical path (stage 0 pays it in full). As DDP does it, each parameter's gradient
here is a view into one flat buffer per bucket (``bucket_bytes``, parameters in reverse order, as the backward
produces them), autograd accumulates into those views in place, and a bucket's all-reduce starts
(asynchronously: gloo's work thread on CPU, NCCL's own stream on GPU) as soon as the action that finishes its parameters' gradients (the last micro-batch's backward, or its weight
pass under zb-h1; per chunk under interleaved and zb-v schedules, whose chunks finish at different times) has
finished every gradient in it. The ``AR`` action then only waits for what the rest of the backward could not hide
(``hethub.partitioner.costmodel.allreduce_end_s`` models the same thing).

Order: a communicator runs collectives in issue order, so buckets start strictly in index order on every rank
(a bucket ready early waits for its predecessors); the index order is the parameter order, the same on every
replica of a stage. A tensor-parallel parameter (a DTensor) cannot take a view of a plain buffer as its
gradient: it is its own one-tensor member of its bucket, reduced in place on its shard. Where the replicas
span vendors each bucket crosses the host bridge: copied into a pinned host buffer without blocking the host (the
autograd hook returns at once, the backward keeps launching), and a bridge thread waits for that copy's event,
then runs the gloo all-reduce; ``AR`` copies the sum back.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .tp import is_dtensor, local


class _Bucket:
    """Parameters reduced together: ``flat`` holds the gradients of ``viewed`` (as views); ``alone`` are
    reduced one by one, in place."""

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.viewed = [p for p in params if _viewable(p)]
        self.alone = [p for p in params if not _viewable(p)]
        self.params = list(params)
        n = sum(p.numel() for p in self.viewed)
        first = params[0]
        self.flat = torch.zeros(n, dtype=first.dtype, device=local(first).device) if self.viewed else None
        self.views, offset = [], 0
        for p in self.viewed:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = 0  # gradients still to come in the armed action
        self.works: list = []  # (tensor, wire, work) while in flight


def _viewable(p: torch.nn.Parameter) -> bool:
    return not is_dtensor(p) and p.is_contiguous()


def bucket_params(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Reverse parameter order, cut where a bucket reaches ``bucket_bytes`` or the dtype changes."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = local(p).numel() * p.element_size()
        if not out or size >= bucket_bytes or out[-1][0].dtype != p.dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


class Buckets:
    """One rank's buckets over its stage's data-parallel group. ``run(fn, what)`` runs a communication call
    through the rank's guard (a lost peer ends the rank with one line)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_bytes: int, group, bridged: bool,
                 run: Callable):
        self.group, self.bridged, self._run = group, bridged, run
        self._host: dict[int, torch.Tensor] = {}  # bridged: each reduced tensor's pinned host buffer
        self._pool: Optional[ThreadPoolExecutor] = None  # bridged: the thread running the gloo all-reduces
        self.buckets = [_Bucket(ps) for ps in bucket_params(params, bucket_bytes)]
        self.where = {id(p): k for k, b in enumerate(self.buckets) for p in b.params}
        self.armed: frozenset = frozenset()  # parameters whose gradients the running action finishes
        self.next_launch = 0
        self.touched: set[int] = set()  # parameters given a gradient this iteration
        self.final: set[int] = set()  # parameters whose gradient is final this iteration
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._accumulated)

    def prepare(self) -> None:
        """Before an iteration's first backward: every gradient is its (zeroed) view, nothing in flight."""
        for b in self.buckets:
            if b.flat is not None:
                b.flat.zero_()
            for p, v in zip(b.viewed, b.views):
                p.grad = v
            b.pending = len(b.params)
            b.works = []
        self.next_launch, self.touched, self.final, self.armed = 0, set(), set(), frozenset()

    def arm(self, params: frozenset) -> None:
        """Ids of the parameters whose last gradient of the iteration the running action accumulates (empty
        between such actions): a gradient of one of them accumulated now is final."""
        self.armed = params

    def _accumulated(self, p: torch.Tensor) -> None:
        self.ready([p])

    def ready(self, params: Sequence[torch.Tensor]) -> None:
        """``params``' gradients were just accumulated (autograd's hook, or zb-h1's weight pass)."""
        for p in params:
            k = self.where.get(id(p))
            if k is None:
                continue
            self.touched.add(id(p))
            if id(p) in self.armed and id(p) not in self.final:
                self.final.add(id(p))
                self.buckets[k].pending -= 1
        while (self.next_launch < len(self.buckets)
               and self.buckets[self.next_launch].pending <= 0):
            self._launch(self.buckets[self.next_launch])

    def _launch(self, b: _Bucket) -> None:
        tensors = ([b.flat] if b.flat is not None else []) + [self._alone_grad(p) for p in b.alone]
        for t in tensors:
            if self.bridged and t.device.type != "cpu":
                wire, work = self._bridge(t)
            else:
                wire, work = t, self._run(lambda: dist.all_reduce(t, group=self.group, async_op=True), "AR")
            b.works.append((t, wire, work))
        self.next_launch += 1

    def _bridge(self, t: torch.Tensor):
        """``t`` copied into its pinned host buffer (kept from step to step) without waiting, and its all-reduce
        handed to the bridge thread (one: buckets start in index order), which waits for the copy first. The
        buffer is reused safely: the next step's copy into it is stream-ordered after this step's copy out."""
        host = self._host.get(id(t))
        if host is None or host.shape != t.shape:
            host = self._host[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hethub-bridge")

        def reduce():
            copied.synchronize()
            dist.all_reduce(host, group=self.group)
        return host, self._pool.submit(reduce)

    @staticmethod
    def _alone_grad(p: torch.nn.Parameter) -> torch.Tensor:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return local(p.grad)

    def finish(self) -> None:
        """The ``AR`` action: start what the backward did not, wait for every bucket; a parameter no action gave a
        gradient has none again (so the optimizer skips it, as without buckets)."""
        while self.next_launch < len(self.buckets):
            self._launch(self.buckets[self.next_launch])
        for b in self.buckets:
            for t, wire, work in b.works:
                self._run(work.wait if hasattr(work, "wait") else work.result, "AR")
                if wire is not t:
                    t.copy_(wire, non_blocking=True)
            b.works = []
        for b in self.buckets:
            for p in b.params:
                if id(p) not in self.touched:
                    p.grad = None
        self.armed = frozenset()


def maybe_buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int, group, bridged: bool, width: int,
                  run: Callable) -> Optional[Buckets]:
    """Buckets where the stage has replicas to reduce over, else None (nothing to all-reduce)."""
    params = [p for p in params if p.requires_grad]
    return Buckets(params, bucket_bytes, group, bridged, run) if width > 1 and params else None
