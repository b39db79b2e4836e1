"""Boundary tensors between stages of unequal width: metadata, row-slice sends and receives, the host bridge.

A replica owns rows ``[sample_start, sample_stop)`` of every micro-batch; a transfer (``partitioner.schedule``'s
``Transfer``) names a peer and the rows both own. Sends are packed (and cast to the boundary's wire dtype) by
``hethub.kernels.pack`` and posted as ``isend``s that return at once; receives are posted ahead and waited for
only when the forward or backward needs their rows. A boundary whose ``transport`` is ``"host"`` (vendors differ)
goes through gloo groups of its own (one per direction) on pinned host buffers, copied without blocking the host.

Every activation send is preceded by a metadata message (dtype, requires-grad, trailing shape of each tensor), as
Megatron's variable-length pipeline does: what crosses may change between micro-batches (bucketed sequence
lengths), between steps, and between evaluation (nothing requires grad) and training; it travels in one
operation with the rows of the first tensor to each peer. The receiver posts the metadata's receive at ``RA`` and
its data receives once the metadata has arrived: on a gloo group its lane thread does both in one operation; on
NCCL the main thread posts the data receives at the next ``RA`` of the same boundary, at the forward that needs
them, or as soon as a check between actions (``progress``) finds the metadata arrived.
A group's operations stay in posting order on both sides (metadata, then the data it describes), the order
``partitioner.ordering`` replays. In a tensor-parallel group the lead alone talks to the neighbouring stages and
broadcasts what it received (metadata, then tensors) to the group.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..kernels import WIRE_DTYPES, pack, unpack, wire_dtype_for, wire_layout
from ..partitioner.groups import SEND_WINDOW
from .errors import Guard
from .ordered import Op, OrderedGroups

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.int8, torch.int16]
META_LEN = 64  # int64 slots of one tensor-metadata message
Meta = list[tuple[torch.dtype, tuple, bool]]  # (dtype, trailing shape, requires grad) per tensor


def encode_meta(tensors: Sequence[tuple[torch.Tensor, bool]]) -> torch.Tensor:
    """(dtype, requires grad, trailing shape) of each (tensor, requires grad) as one int64 message."""
    meta = torch.zeros(META_LEN, dtype=torch.int64)
    meta[0] = len(tensors)
    pos = 1
    for t, req in tensors:
        if pos + 2 + t.dim() > META_LEN:
            raise ValueError("hethub: too many or too high-dimensional tensors cross a stage boundary")
        meta[pos] = DTYPES.index(t.dtype)
        meta[pos + 1] = int(req)
        meta[pos + 2] = t.dim() - 1
        meta[pos + 3:pos + 2 + t.dim()] = torch.tensor(t.shape[1:], dtype=torch.int64)
        pos += 2 + t.dim()
    return meta


def decode_meta(meta: torch.Tensor) -> Meta:
    m, out, pos = meta.tolist(), [], 1
    for _ in range(m[0]):
        dtype, req, nd = DTYPES[m[pos]], bool(m[pos + 1]), m[pos + 2]
        out.append((dtype, tuple(m[pos + 3:pos + 3 + nd]), req))
        pos += 3 + nd
    return out


class _MetaPending:
    """A posted activation receive whose metadata has not been read yet: its metadata receives (one per peer), the
    action's peers and route; its data receives are posted once the metadata is read."""

    def __init__(self, ops: list, metas: list, transfers, route: "_Route"):
        self.ops, self.metas, self.transfers, self.route = ops, metas, transfers, route


class _Posted:
    """A posted receive: its operations, one buffer per tensor (each peer fills its slice), what they hold, and
    the rows they go to."""

    def __init__(self, ops: list, pieces: list, specs: Sequence[tuple[torch.dtype, tuple]], ranges: list):
        self.ops, self.pieces, self.specs, self.ranges = ops, pieces, specs, ranges
        self.mismatch = False  # the peers' metadata differed (read on a lane thread, raised at the take)


class Transport:
    """One rank's boundary traffic. Built once per engine; ``reset`` starts an iteration.

    Activations and their metadata travel on the forward group of their boundary, gradients on its backward
    group (``grid.p2p``); on each group this rank's operations run in the order the schedule posts them
    (``ordered``), the order ``partitioner.ordering`` proves deadlock-free. A tensor lives on its group's device:
    host memory for gloo groups (the bridge, CPU runs), the rank's accelerator otherwise. Sends are released as
    they complete, not at the end of the iteration, and at most ``SEND_WINDOW`` are held per (direction, peer): a
    send to a peer with that many unfinished waits for the oldest (the NCCL-order replay proves the schedules
    finish under that bound, and the simulator times it).

    ``default_wire`` is the wire dtype of a boundary whose plan entry names none: the run's 16-bit training
    dtype, so that a bf16/fp16 run sends what the cost model prices (the residual stream stays fp32 under
    autocast, and would otherwise cross at twice the bytes); a boundary's own ``dtype`` (``fp32`` included) wins."""

    def __init__(self, grid, device: torch.device, guard: Guard, default_wire: Optional[str] = None):
        self.grid, self.device, self.guard = grid, device, guard
        self.default_wire = default_wire
        self.rows = grid.sample_stop - grid.sample_start  # this replica's rows of a micro-batch
        self.is_lead = grid.tp_rank == 0  # talks to the neighbouring stages (every rank without TP)
        self.waited_s = 0.0  # seconds spent waiting for receives since the executor last read it
        # HETHUB_ISSUE_AT_ONCE=1 (tests): gloo groups issued at once as NCCL's are, so that the NCCL path of the
        # metadata (read by the main thread, data receives posted after it) runs on CPU too
        at_once = os.environ.get("HETHUB_ISSUE_AT_ONCE") == "1"
        self.ops = OrderedGroups(guard, strict=(lambda g: False) if at_once else grid.on_host)
        self.peak_sends: dict[tuple[str, int], int] = {}  # (direction, peer) -> most sends held at once
        self._send_id = 0  # one per send action: its messages to a peer (metadata, every tensor) are one send
        self._metas: dict[tuple, torch.Tensor] = {}  # (device, what is sent) -> its metadata message, made once
        self.reset()

    def reset(self) -> None:
        self._recvs: dict[tuple[str, int, int], _Posted] = {}  # ("A"|"G", mb, chunk) -> posted receive
        # chunk -> (mb, its receive whose metadata is not read yet): at most one per chunk, the last operation
        # posted on that boundary's forward group, so its data receives may follow it there
        self._meta_pending: dict[int, tuple[int, _MetaPending]] = {}
        self._recv_meta: dict[tuple[int, int], Meta] = {}  # (mb, chunk) -> what its posted receive will hold
        # (operation, direction, peer, send id, buffer) of each message in flight, oldest first
        self._sends: list[tuple[Op, str, int, int, torch.Tensor]] = []
        # ("A"|"G", mb, chunk) -> tensors a rank handed to its own next (or previous) chunk: zb-v's turn
        self._handed: dict[tuple[str, int, int], list[torch.Tensor]] = {}

    # ------------------------------------------------------------------ the four transfers of a schedule
    # ``k`` is the pipeline chunk (``Plan.pipeline`` position) the action belongs to: activations leave chunk k
    # across the boundary after it and arrive at chunk k from the boundary before it; gradients the other way.
    def send_activations(self, mb: int, outputs: tuple, transfers, k: int) -> None:
        if self._local(transfers):
            self._hand("A", mb, k + 1, outputs)
            return
        if not self.is_lead:
            return  # the group's lead sends the (replicated) output once
        route = self._route("fwd", k)
        self._make_room(route.direction, transfers)
        self._post_sends(outputs, transfers, route, meta=self._meta_message(outputs, route))

    def recv_activations(self, mb: int, transfers, k: int) -> None:
        """Post the metadata receives of micro-batch ``mb``'s activations; the previous receive on this boundary
        first gets its data receives (its metadata is waited for here: they must precede these on the group)."""
        if not self.is_lead or self._local(transfers):
            return  # the lead receives and shares at the forward (take); a rank's own rows are handed over
        self._resolve(k)
        route = self._route("fwd", k - 1)
        if self.ops.strict(route.group):  # a lane serves the group: it posts the data receives itself, at once
            self._recv_on_lane(mb, k, transfers, route)
            return
        metas = [torch.zeros(META_LEN, dtype=torch.int64, device=route.device) for _ in transfers]
        ops = [self.ops.issue(route.group, lambda m=m, p=p: dist.irecv(m, p.peer, group=route.group))
               for m, p in zip(metas, transfers)]
        self._meta_pending[k] = (mb, _MetaPending(ops, metas, transfers, route))

    def _recv_on_lane(self, mb: int, k: int, transfers, route: "_Route") -> None:
        """An activation receive on a gloo group as one lane operation: the metadata from each peer, then, read on
        the lane thread as soon as it is in, the data receives it describes, posted right behind it (the same
        order on the group as on NCCL, where the main thread must read the metadata first)."""
        posted = _Posted([], [], [], [])
        metas = [torch.zeros(META_LEN, dtype=torch.int64) for _ in transfers]

        def receive() -> "_Works":
            for m, t in zip(metas, transfers):
                dist.irecv(m, t.peer, group=route.group).wait()
            if any(not torch.equal(m, metas[0]) for m in metas):
                posted.mismatch = True
                return _Works([])
            meta = self._recv_meta[(mb, k)] = decode_meta(metas[0])
            posted.specs = [(d, sh) for d, sh, _ in meta]
            posted.pieces, pieces, posted.ranges = self._recv_buffers(posted.specs, transfers, route)
            return _Works([dist.irecv(piece, peer, group=route.group) for piece, peer in pieces])
        posted.ops = [self.ops.issue(route.group, receive)]
        self._recvs[("A", mb, k)] = posted

    def progress(self) -> None:
        """Between actions: post the data receives of every activation receive whose metadata has arrived (earlier
        than the next ``RA`` or forward would, so that the data can flow while this rank computes)."""
        for k in [k for k, (_, p) in self._meta_pending.items() if all(self.ops.is_done(op) for op in p.ops)]:
            self._resolve(k)

    def _resolve(self, k: int) -> None:
        """Read the pending metadata of chunk ``k``'s receive (waiting for it) and post its data receives."""
        if k not in self._meta_pending:
            return
        mb, pending = self._meta_pending.pop(k)
        t0 = time.perf_counter()
        for op in pending.ops:
            self.ops.wait(op)
        self.waited_s += time.perf_counter() - t0
        metas = [m.cpu() for m in pending.metas]
        if any(not torch.equal(m, metas[0]) for m in metas):
            raise RuntimeError("hethub: replicas of the previous stage send tensors of different shapes")
        meta = self._recv_meta[(mb, k)] = decode_meta(metas[0])
        self._post_recvs("A", mb, k, [(d, s) for d, s, _ in meta], pending.transfers, pending.route)

    def send_grads(self, mb: int, grads: Sequence[torch.Tensor], transfers, k: int) -> None:
        if self._local(transfers):
            self._hand("G", mb, k - 1, grads)
        elif self.is_lead:
            route = self._route("bwd", k - 1)
            self._make_room(route.direction, transfers)
            self._post_sends(grads, transfers, route)

    def recv_grads(self, mb: int, outputs: Sequence[torch.Tensor], transfers, k: int) -> None:
        if self.is_lead and not self._local(transfers):
            self._post_recvs("G", mb, k, [(o.dtype, tuple(o.shape[1:])) for o in outputs], transfers,
                             self._route("bwd", k))

    def take(self, kind: str, mb: int, k: int, like: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """This replica's full tensors of a posted receive (or of what the rank handed itself). In a
        tensor-parallel group the lead received them and broadcasts them to the others (``like``: tensors of the
        shapes to expect, for gradients). Received activations require grad where the sender's did and gradients
        are enabled here (evaluation sends none that do; a frozen stage's may not)."""
        if (kind, mb, k) in self._handed:
            out, meta = self._handed.pop((kind, mb, k))
        else:
            meta = None
            if self.is_lead:
                if kind == "A" and self._meta_pending.get(k, (None,))[0] == mb:
                    self._resolve(k)
                out = self._take_own(kind, mb, k)
                meta = self._recv_meta.pop((mb, k), None)  # after the wait: a lane may have read it
            else:
                out = None
            if self.grid.tp > 1:
                out, meta = self._tp_share(kind, out, meta, like)
        if kind == "A":
            for t, (_, _, req) in zip(out, meta):
                t.requires_grad_(req and torch.is_grad_enabled())
        return out

    def _local(self, transfers) -> bool:
        """A transfer between two chunks of this rank's own group (zb-v's turn): every row stays on this rank (the
        peer is its replica's lead, whose action list a tensor-parallel group's ranks all run)."""
        return all(t.peer == self.grid.schedule_rank for t in transfers)

    def _hand(self, kind: str, mb: int, k: int, tensors: Sequence[torch.Tensor]) -> None:
        """Rows a rank passes to its own chunk ``k``: the tensors themselves, cut from the graph that made them
        (chunk k's backward stops at them, as at a received tensor), no copy, no cast, no group operation. Every
        rank of a tensor-parallel group holds them already (replicated), so none is shared."""
        self._handed[(kind, mb, k)] = ([t.detach() for t in tensors], _meta_of(tensors))

    def release_sends(self) -> None:
        """Drop the buffers of sends that have completed (called after every action)."""
        self._sends = [s for s in self._sends if not self.ops.is_done(s[0])]
        for key, ids in self._held().items():
            self.peak_sends[key] = max(self.peak_sends.get(key, 0), len(ids))

    def _held(self) -> dict[tuple[str, int], list[int]]:
        """(direction, peer) -> ids of the sends not yet finished, oldest first."""
        held: dict[tuple[str, int], list[int]] = {}
        for _op, direction, peer, sid, _buf in self._sends:
            ids = held.setdefault((direction, peer), [])
            if sid not in ids:
                ids.append(sid)
        return held

    def _make_room(self, direction: str, transfers) -> None:
        """Before a send action: wait until each of its peers has fewer than ``SEND_WINDOW`` unfinished sends
        from this rank (the oldest finish first: a group's operations run in order), then open a new send."""
        self._send_id += 1
        self.release_sends()
        for t in transfers:
            ids = self._held().get((direction, t.peer), [])
            if len(ids) >= SEND_WINDOW:
                t0 = time.perf_counter()
                for op, d, peer, sid, _buf in list(self._sends):
                    if d == direction and peer == t.peer and sid in ids[:len(ids) - SEND_WINDOW + 1]:
                        self.ops.wait(op)
                self.waited_s += time.perf_counter() - t0
                self.release_sends()

    def wait_sends(self) -> None:
        """Every operation of the iteration has finished (the sends still in flight, in the order they left)."""
        self._sends = []
        self.ops.wait_all()

    # ------------------------------------------------------------------ metadata
    def _meta_message(self, outputs: tuple, route) -> torch.Tensor:
        """The metadata message before each activation send. Its tensor is made (and copied to the group's
        device) once per distinct signature, not per send: every send of the same shapes posts the same tensor."""
        signature = (route.device, tuple(_meta_of(outputs)))
        meta = self._metas.get(signature)
        if meta is None:
            if len(self._metas) >= 64:  # lengths that keep changing: keep the cache small
                self._metas.clear()
            meta = self._metas[signature] = encode_meta([(t, req) for t, (_, _, req) in
                                                         zip(outputs, signature[1])]).to(route.device)
        return meta

    # ------------------------------------------------------------------ row slices
    def _route(self, direction: str, after: int) -> "_Route":
        """The group, device and wire dtype of one direction of the boundary after pipeline chunk ``after``."""
        group, boundary = self.grid.p2p[(direction, after)], self.grid.plan.boundary(after)
        host = self.grid.on_host(group)
        return _Route(direction, group, torch.device("cpu") if host else self.device,
                      boundary.dtype if boundary is not None and boundary.dtype else self.default_wire)

    def _post_sends(self, tensors: Sequence[torch.Tensor], transfers, route: "_Route",
                    meta: Optional[torch.Tensor] = None) -> None:
        """isend each peer its rows of every tensor, packed (and cast to the boundary's wire dtype); ``meta``, the
        metadata message, goes to each peer in one operation with its rows of the first tensor, just before them
        (one lane hand-off per peer, not two: the order each peer sees is the same)."""
        base = self.grid.sample_start
        ranges = [(t.start - base, t.stop - base) for t in transfers]
        for i, x in enumerate(tensors):
            x = x.detach()
            if x.dtype in WIRE_DTYPES:
                buf = pack(x, ranges, wire_dtype_for(x.dtype, route.wire))
            else:  # integer side inputs (masks, ids) and float64 travel as they are
                buf = torch.cat([x[a:b] for a, b in ranges]) if ranges else x[:0]
            buf, ready = _to_host(buf) if route.device.type == "cpu" and buf.device.type != "cpu" else (buf, None)
            off = 0
            for (a, b), t in zip(ranges, transfers):
                pieces = [meta, buf[off:off + b - a]] if meta is not None and i == 0 else [buf[off:off + b - a]]
                op = self.ops.issue(route.group, lambda pieces=pieces, t=t: _Works(
                    [dist.isend(piece, t.peer, group=route.group) for piece in pieces]), ready)
                self._sends += [(op, route.direction, t.peer, self._send_id, piece) for piece in pieces]
                off += b - a

    def _post_recvs(self, kind: str, mb: int, k: int, specs: Sequence[tuple[torch.dtype, tuple]], transfers,
                    route: "_Route") -> None:
        """irecv this replica's rows of each tensor (dtype, trailing shape) from the action's peers, each peer's
        rows straight into its slice of one buffer per tensor (no concatenation afterwards)."""
        buffers, pieces, ranges = self._recv_buffers(specs, transfers, route)
        ops = [self.ops.issue(route.group, lambda piece=piece, peer=peer: dist.irecv(piece, peer, group=route.group))
               for piece, peer in pieces]
        self._recvs[(kind, mb, k)] = _Posted(ops, buffers, specs, ranges)

    def _recv_buffers(self, specs: Sequence[tuple[torch.dtype, tuple]], transfers, route: "_Route"):
        """One buffer per tensor for this replica's rows of it; the (slice, peer) each receive fills, in posting
        order (tensor by tensor, the action's peers in order); the rows' ranges."""
        base = self.grid.sample_start
        ranges = [(t.start - base, t.stop - base) for t in transfers]
        buffers, pieces = [], []
        pin = route.device.type == "cpu" and self.device.type != "cpu"  # the host bridge: pinned, copied async
        for dtype, shape in specs:
            wdt = wire_dtype_for(dtype, route.wire) if dtype in WIRE_DTYPES else None
            bdt, row_shape = wire_layout(dtype, shape, wdt)
            whole = torch.empty((sum(b - a for a, b in ranges), *row_shape), dtype=bdt, device=route.device,
                                pin_memory=pin)
            off = 0
            for (a, b), t in zip(ranges, transfers):
                pieces.append((whole[off:off + b - a], t.peer))
                off += b - a
            buffers.append(whole)
        return buffers, pieces, ranges

    def _take_own(self, kind: str, mb: int, k: int) -> list[torch.Tensor]:
        """Wait for a posted receive; unpack and up-cast its buffers into this replica's full tensors."""
        posted = self._recvs.pop((kind, mb, k))
        t0 = time.perf_counter()
        for op in posted.ops:
            self.ops.wait(op)
        self.waited_s += time.perf_counter() - t0
        if posted.mismatch:
            raise RuntimeError("hethub: replicas of the previous stage send tensors of different shapes")
        out = []
        for (dtype, shape), whole in zip(posted.specs, posted.pieces):
            buf = whole.to(self.device, non_blocking=True)
            full = torch.empty((self.rows, *shape), dtype=dtype, device=self.device)
            if dtype in WIRE_DTYPES:
                unpack(buf, full, posted.ranges)
            else:
                off = 0
                for a, b in posted.ranges:
                    full[a:b].copy_(buf[off:off + b - a])
                    off += b - a
            out.append(full)
        return out

    def _tp_share(self, kind: str, tensors: Optional[list], meta: Optional[Meta], like: Sequence[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], Optional[Meta]]:
        """Broadcast the lead's received tensors over the tensor-parallel group: activations after their
        metadata (it may change from one micro-batch to the next); gradients are shaped like this rank's own
        outputs."""
        group, lead = self.grid.tp_group, self.grid.tp_lead
        self.guard.peers = tuple(self.grid.tp_ranks)
        what = "the tensor-parallel broadcast"
        if kind == "A":
            where = "cpu" if self.grid.on_host(group) else self.device
            message = torch.zeros(META_LEN, dtype=torch.int64, device=where)
            if self.is_lead:
                message = encode_meta([(t, req) for t, (_, _, req) in zip(tensors, meta)]).to(where)
            self.guard(lambda: dist.broadcast(message, src=lead, group=group), what)
            meta = decode_meta(message.cpu())
        if tensors is None:
            tensors = ([torch.empty((self.rows, *shape), dtype=d, device=self.device) for d, shape, _ in meta]
                       if kind == "A" else [torch.empty_like(t) for t in like])
        for t in tensors:
            self.guard(lambda: dist.broadcast(t, src=lead, group=group), what)
        return tensors, meta


def _meta_of(tensors: Sequence[torch.Tensor]) -> Meta:
    """What a metadata message would say of ``tensors`` (for rows a rank hands itself)."""
    return [(t.dtype, tuple(t.shape[1:]), t.is_floating_point() and t.requires_grad) for t in tensors]


class _Works:
    """Several works of one operation (a metadata message and the rows after it, to one peer) as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Route:
    """Where one direction of one boundary goes: its group, the device its tensors live on, the wire dtype."""

    def __init__(self, direction: str, group, device: torch.device, wire: Optional[str]):
        self.direction, self.group, self.device, self.wire = direction, group, device, wire


def _to_host(buf: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A device tensor copied into pinned host memory without blocking the host: the copy and an event the send
    waits for before gloo reads the memory (the bridge's device -> host half). The pinned block comes from torch's
    caching host allocator, which hands it out again once the send is released (at most ``SEND_WINDOW`` per
    peer are held), so steady state pins no new memory."""
    host = torch.empty(buf.shape, dtype=buf.dtype, device="cpu", pin_memory=True)
    host.copy_(buf, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event.synchronize
