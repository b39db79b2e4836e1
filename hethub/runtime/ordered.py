"""Point-to-point operations that run in issue order per group, as NCCL runs them, on every backend.

NCCL queues a communicator's operations on one stream: on each rank they run one after another in the order they
were issued, and a receive finishes only when its send runs. gloo matches messages by (peer, tag) and would let a
later receive finish first, which hides orders that hang on GPUs. So on gloo groups (CPU runs, the host bridge)
hethub starts an operation only when the one before it on the same group has finished: the CPU tests then run
under the GPU's rule, and a schedule that would deadlock on NCCL hangs there too (and ends at the timeout with a
line naming the peers). On NCCL/RCCL groups operations are issued at once; the communicator keeps the order itself.

A gloo group's queue is served by a thread of its own (gloo's point-to-point works report completion only through
``wait()``, so a single thread cannot poll several): it starts the head operation, waits for it, then the next,
while the rank's main thread computes or waits elsewhere, as the GPU's streams progress on their own.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

from .errors import Guard


class Op:
    """One send or receive, started by ``start()`` (which returns torch's work); ``ready`` (optional) is waited
    for first (e.g. the device -> host copy a bridge send reads)."""

    def __init__(self, start: Callable[[], object], ready: Optional[Callable[[], None]], laned: bool):
        self.start, self.ready, self.laned = start, ready, laned
        self.work = None
        self.error: Optional[BaseException] = None
        self.finished = threading.Event()

    @property
    def done(self) -> bool:
        return self.finished.is_set()


class _Lane(threading.Thread):
    """The thread serving one gloo group's operations, strictly one after another."""

    def __init__(self):
        super().__init__(daemon=True)
        self.todo: "queue.Queue[Op]" = queue.Queue()
        self.start()

    def run(self) -> None:
        while True:
            op = self.todo.get()
            try:
                if op.ready is not None:
                    op.ready()
                op.work = op.start()
                op.work.wait()
            except RuntimeError as exc:  # a peer died or hung: the main thread reports it through its guard
                op.error = exc
            op.finished.set()


class OrderedGroups:
    """This rank's point-to-point operations. ``strict(group)``: whether a group's order is kept here (gloo, by a
    lane thread) or left to its backend (NCCL/RCCL, issued at once)."""

    def __init__(self, guard: Guard, strict: Callable[[object], bool]):
        self.guard, self.strict = guard, strict
        self._lanes: dict[object, _Lane] = {}
        self._pending: list[Op] = []

    def issue(self, group, start: Callable[[], object], ready: Optional[Callable[[], None]] = None) -> Op:
        op = Op(start, ready, laned=self.strict(group))
        if op.laned:
            if group not in self._lanes:
                self._lanes[group] = _Lane()
            self._lanes[group].todo.put(op)
        else:
            if ready is not None:
                ready()
            op.work = self.guard(start)
        self._pending.append(op)
        return op

    def is_done(self, op: Op) -> bool:
        """Whether ``op`` has finished (an NCCL/RCCL one: its work says so); never blocks."""
        if not op.laned and not op.done and op.work.is_completed():
            op.finished.set()
        return op.done

    def wait(self, op: Op) -> None:
        """Block until ``op`` has finished (and, on its group, every operation issued before it)."""
        if not op.laned:
            if not op.done:
                self.guard(op.work.wait)  # NCCL/RCCL: the backend keeps the order; this orders the compute stream
                op.finished.set()
            return
        op.finished.wait()
        if op.error is not None:
            error, op.error = op.error, None
            self.guard.lost(self.guard.what, error)

    def wait_all(self) -> None:
        """Every operation issued so far has finished (the end of an iteration)."""
        pending, self._pending = self._pending, []
        for op in pending:
            self.wait(op)
