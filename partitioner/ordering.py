"""A schedule replayed under NCCL's ordering: does every rank's action list finish?

NCCL runs a communicator's operations in the order each rank issues them, on one stream, and a receive completes
only when its matching send runs. gloo matches messages by (peer, tag) instead, so an order that deadlocks on GPUs
passes on CPU. This replay is the GPU's rule, checked on data, before launch: ``hethub simulate`` and
``hethub.initialize`` refuse a schedule that fails it, naming the rank and the action it is stuck at.

The model (conservative: rendezvous for every message, so a schedule that passes cannot hang on NCCL's weaker
buffered sends either):

- Each transfer action posts, per tensor, one operation per peer, in the action's peer order, on its group
  (``groups.transfer_group``: activations on the boundary's forward group, gradients on its backward group). Every
  ``SA`` sends each peer a metadata message just before its rows of the first tensor (shapes may change between
  micro-batches); an ``RA`` posts
  the metadata receives only, and its data receives follow once that metadata is read: at the next ``RA`` on the
  same group, or at the forward that needs them, which wait for it there (the runtime does exactly this; it may
  also post them sooner, between actions, when the metadata has arrived, which only lets messages match earlier).
- Per (rank, group), operations run one at a time in posting order; the head send of rank a to b and the head
  receive of b from a run together, and must be the same message (else the data would land in the wrong buffer).
- **Bounded sends.** A rank keeps at most ``SEND_WINDOW`` (2) unfinished sends per (direction, peer): an ``SA`` or
  ``SG`` whose peer already has two waits, blocking the rank, until the oldest has run (the runtime holds each
  send's buffer until it completes; without the bound a stage running ahead of its neighbour would hold one per
  micro-batch). A send's messages to one peer (its tensors, and the metadata before the first) count as one.
- ``F`` waits for its ``RA``'s receives, ``B`` for its ``RG``'s; ``AR`` waits for the stage's replicas, ``OPT``
  for every rank (the gradient norm); at the end a rank waits for all of its operations.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .errors import InputError
from .groups import SEND_WINDOW, transfer_group
from .records import Plan
from .schedule import Action


def vstage(plan: Plan, rank: int, a: Action) -> int:
    """The pipeline position an action works at: its chunk in a chunked plan, else its rank's stage."""
    return a.chunk if a.chunk is not None else plan.locate(rank)[0]

GroupOf = Callable[[str, int], tuple]  # (action kind, stage) -> the group key its operations use


class OrderError(InputError):
    """A schedule that deadlocks, or mis-delivers a message, under NCCL's ordering."""


class MispairedError(OrderError):
    """Two ranks' next operations on a group are different messages: NCCL would deliver one into the other's
    buffer (where tags would have matched them)."""


@dataclass
class _Op:
    send: bool
    rank: int
    peer: int
    message: tuple  # what travels: ("meta" | kind, micro-batch, tensor)
    action: str
    done: bool = False


@dataclass
class _Rank:
    rank: int
    stage: int
    actions: list[Action]
    pc: int = 0  # the next action
    posted: dict = field(default_factory=dict)  # (kind, mb, chunk) -> its ops
    pending: dict = field(default_factory=dict)  # group -> (RA action, its metadata receives) not yet read
    ops: list = field(default_factory=list)
    sends: dict = field(default_factory=dict)  # (direction, peer) -> ops of each send not yet finished, oldest first


def per_direction(kind: str, stage: int) -> tuple:
    """The runtime's assignment: one group per (boundary, direction)."""
    return transfer_group(kind, stage)


def one_group_per_boundary(kind: str, stage: int) -> tuple:
    """Both directions of a boundary on one group: the layout that deadlocks (kept to test the replay itself)."""
    return ("both", transfer_group(kind, stage)[1])


class _Replay:
    def __init__(self, plan: Plan, schedule: dict[int, list[Action]], n_tensors: int, group_of: GroupOf):
        self.plan, self.n_tensors, self.group_of = plan, n_tensors, group_of
        self.ranks = {r: _Rank(r, plan.locate(r)[0], list(acts)) for r, acts in schedule.items()}
        self.queues: dict[tuple, deque] = {}  # (rank, group) -> its operations not yet run
        self.at_barrier: dict[str, set] = {}

    def _group(self, st: _Rank, a: Action):
        return self.group_of(a.kind, vstage(self.plan, st.rank, a))

    def _post(self, st: _Rank, a: Action, meta: bool = False) -> list[_Op]:
        """A transfer's operations on its group; a rank handing rows to itself (zb-v's turn, where one group holds
        two consecutive chunks) moves them locally, with no operation."""
        group = self._group(st, a)
        send = a.kind in ("SA", "SG")
        peers = [t.peer for t in a.transfers if t.peer != st.rank]
        data = [(a.kind[1], a.mb, k) for k in range(self.n_tensors)]
        if not meta:
            order = [(m, p) for m in data for p in peers]
        elif send:  # an activation send: to each peer its metadata, then its rows of the first tensor; the rest
            order = [(m, p) for p in peers for m in (("meta", a.mb, 0), data[0])] + [(m, p) for m in data[1:]
                                                                                      for p in peers]
        else:  # a receive's metadata, from each peer (its data receives follow once they are read)
            order = [(("meta", a.mb, 0), p) for p in peers]
        ops = [_Op(send, st.rank, p, m, str(a)) for m, p in order]
        for op in ops:
            self.queues.setdefault((st.rank, group), deque()).append(op)
        st.ops += ops
        return ops

    def _window_full(self, st: _Rank, a: Action) -> bool:
        """Whether a peer of send ``a`` still has ``SEND_WINDOW`` unfinished sends from this rank."""
        for t in a.transfers:
            held = st.sends.get((a.kind, t.peer), [])
            held[:] = [ops for ops in held if not all(op.done for op in ops)]
            if len(held) >= SEND_WINDOW:
                return True
        return False

    def _hold(self, st: _Rank, a: Action, ops: list[_Op]) -> None:
        for t in a.transfers:
            if t.peer != st.rank:
                st.sends.setdefault((a.kind, t.peer), []).append([op for op in ops if op.peer == t.peer])

    def _ready(self, st: _Rank, a: Action) -> bool:
        """Whether the rank may run action ``a`` now (posting it if it posts), else it waits."""
        k, group = a.kind, (self._group(st, a) if a.kind in ("SA", "RA", "SG", "RG") else None)
        if k in ("SA", "SG") and self._window_full(st, a):
            return False
        if k == "SA":
            ops = self._post(st, a, meta=True)
            st.posted[("A", a.mb, a.chunk)] = ops
            self._hold(st, a, ops)
        elif k == "RA":
            if not self._resolve(st, group):
                return False
            st.pending[group] = (a, self._post(st, a, meta=True))
        elif k in ("SG", "RG"):
            st.posted[("G", a.mb, a.chunk)] = self._post(st, a)
            if k == "SG":
                self._hold(st, a, st.posted[("G", a.mb, a.chunk)])
        elif k == "F" and vstage(self.plan, st.rank, a) > 0:
            group = self.group_of("RA", vstage(self.plan, st.rank, a))
            ra = st.pending.get(group)
            if ra is not None and ra[0].mb == a.mb and not self._resolve(st, group):
                return False
            return all(op.done for op in st.posted.get(("A", a.mb, a.chunk), ()))
        elif k == "B" and vstage(self.plan, st.rank, a) < len(self.plan.pipeline) - 1:
            return all(op.done for op in st.posted.get(("G", a.mb, a.chunk), ()))
        elif k in ("AR", "OPT"):
            return self._barrier(st, k)
        return True

    def _resolve(self, st: _Rank, group) -> bool:
        """Post the data receives of the group's pending ``RA`` once its metadata has arrived (True), else False:
        the rank waits for it."""
        if group not in st.pending:
            return True
        a, metas = st.pending[group]
        if not all(op.done for op in metas):
            return False
        del st.pending[group]
        st.posted[("A", a.mb, a.chunk)] = self._post(st, a)
        return True

    def _barrier(self, st: _Rank, kind: str) -> bool:
        members = ([r.rank for r in self.plan.stages[st.stage].replicas] if kind == "AR" else list(self.ranks))
        key = f"{kind}{st.stage}" if kind == "AR" else kind
        arrived = self.at_barrier.setdefault(key, set())
        arrived.add(st.rank)
        return all(m in arrived for m in members if m in self.ranks)

    def _advance(self, st: _Rank) -> bool:
        moved = False
        while st.pc < len(st.actions):
            a = st.actions[st.pc]
            if not self._ready(st, a):
                break
            st.pc += 1
            moved = True
        return moved

    def _match(self) -> bool:
        moved = False
        for (rank, group), q in list(self.queues.items()):
            if not q:
                continue
            op = q[0]
            other = self.queues.get((op.peer, group))
            if not other or other[0].peer != rank or other[0].send == op.send:
                continue
            peer_op = other[0]
            if peer_op.message != op.message:
                raise MispairedError("schedule", f"rank {rank} at {op.action} and rank {op.peer} at {peer_op.action} "
                                                 f"pair different messages ({_text(op.message)} vs "
                                                 f"{_text(peer_op.message)}) on {_group_text(group)}: NCCL matches a "
                                                 "group's messages in posting order")
            op.done = peer_op.done = True
            q.popleft()
            other.popleft()
            moved = True
        return moved

    def run(self) -> None:
        while True:
            moved = any([self._advance(st) for st in self.ranks.values()])
            moved = self._match() or moved
            if not moved:
                break
        stuck = [st for st in self.ranks.values() if st.pc < len(st.actions) or not all(op.done for op in st.ops)]
        if stuck:
            st = min(stuck, key=lambda s: s.rank)
            where = (str(st.actions[st.pc]) if st.pc < len(st.actions) else "the iteration's end (its last sends)")
            head = next((q[0] for (r, _g), q in sorted(self.queues.items(), key=lambda kv: str(kv[0]))
                         if r == st.rank and q), None)
            waits = f"; its group's next operation, {head.action}, waits for rank {head.peer}" if head else ""
            raise OrderError("schedule", f"deadlocks under NCCL's ordering (each group's operations run in issue "
                                         f"order): rank {st.rank} is stuck at {where}{waits}; ranks stuck: "
                                         f"{', '.join(str(s.rank) for s in sorted(stuck, key=lambda s: s.rank))[:200]}")


def _text(message: tuple) -> str:
    kind, mb, tensor = message
    return f"metadata of A{mb}" if kind == "meta" else f"{kind}{mb}" + (f" tensor {tensor}" if tensor else "")


def _group_text(group) -> str:
    if isinstance(group, tuple) and len(group) == 2:
        return f"the {group[0]} group of the boundary after stage {group[1]}"
    return f"group {group}"


def check_order(plan: Plan, schedule: dict[int, list[Action]], n_tensors: int = 1,
                group_of: Optional[GroupOf] = None) -> None:
    """Raise ``OrderError`` naming the rank and action where ``schedule`` deadlocks (or pairs two different
    messages) under NCCL's ordering, with the runtime's groups (``group_of`` replaces them, for tests)."""
    _Replay(plan, schedule, n_tensors, group_of or per_direction).run()
