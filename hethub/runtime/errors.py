"""How the runtime ends a rank: a bad input (exit 2) or a lost peer (exit 3), each as one line on stderr.

Why one home: every part (start-up, transport, gradients, checkpoint) reaches the same two verdicts, and each
must end the rank the same way, so peers see it gone within seconds rather than hanging in a collective.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, NoReturn, Optional, Sequence, TypeVar

from ..partitioner.errors import print_error

T = TypeVar("T")


_ENDING = [False]  # this rank is ending on an error: exit hooks skip what needs its peers or its data intact
_ON_FAIL: list[Callable[[str], None]] = []  # told the line of a bad-input end (an elastic job ends itself)


def mark_ending() -> None:
    _ENDING[0] = True


def on_fail(hook: Callable[[str], None]) -> None:
    """``hook(message)`` runs when this rank ends on bad input (``fail``), before it exits."""
    _ON_FAIL.append(hook)


def ending() -> bool:
    """Whether this rank is ending on an error (``fail``, or an uncaught exception seen by start-up's hook)."""
    return _ENDING[0]


def fail(message: str) -> NoReturn:
    """One line on stderr, exit 2 (on every rank: each rank reaches the same verdict from the same input)."""
    mark_ending()
    print_error(message)
    for hook in _ON_FAIL:
        hook(message)
    raise SystemExit(2)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


class Guard:
    """Runs hethub's own communication calls; a failure (a peer died or hung) ends this rank with one line naming
    the peers it was waiting for, the action and the step.

    Only hethub's transfers and collectives go through a guard, so a user's error is never taken for a lost peer.
    ``watch`` says what the next calls are (the executor before each action, a collective before it runs).
    """

    def __init__(self, rank: int, stage: int, world_size: int, step: Callable[[], int]):
        self.rank, self.stage, self.world_size = rank, stage, world_size
        self._step = step
        self.peers: tuple[int, ...] = ()
        self.what = "start-up"
        self._since: Optional[float] = None  # when the watched work began (None: user code runs, not watched)
        self._watchdog: Optional[threading.Thread] = None

    def watch(self, peers: Sequence[int], what: str) -> None:
        self.peers, self.what = tuple(peers), what
        self._since = time.monotonic()

    def idle(self) -> None:
        """hethub's work is done for now (the user's code runs: it may take as long as it likes)."""
        self._since = None

    def start_watchdog(self, deadline_s: float) -> None:
        """On NCCL/RCCL, errors are asynchronous: ``work.wait()`` returns at once, a receive whose peer died never
        raises here, and NCCL's own watchdog ends the process after the groups' timeout with a C++ trace. This
        thread watches hethub's own work instead: one action (or collective) that has not finished after
        ``deadline_s`` (set a little before the groups' timeout) ends the rank with the lost-peer line (exit 3),
        naming the peers it waited for, the action and the step."""
        if self._watchdog is not None:
            return

        def run():
            while True:
                time.sleep(min(1.0, deadline_s / 10))
                since = self._since
                if since is not None and time.monotonic() - since > deadline_s:
                    self.lost(self.what, TimeoutError(f"no progress for {deadline_s:g} s (the device's "
                                                      "collectives report no error of their own)"))
        self._watchdog = threading.Thread(target=run, daemon=True, name="hethub-watchdog")
        self._watchdog.start()

    def __call__(self, fn: Callable[[], T], what: str = "") -> T:
        try:
            return fn()
        except RuntimeError as exc:
            self.lost(what or self.what, exc)

    def lost(self, what: str, exc: BaseException) -> NoReturn:
        peers = self.peers or tuple(range(self.world_size))
        print_error(f"rank {self.rank} (stage {self.stage}) lost rank(s) "
                    f"{', '.join(map(str, sorted(set(peers) - {self.rank})))} during {what} at "
                    f"step {self._step()}: {first_line(exc)}")
        os._exit(3)  # not SystemExit: gloo's threads may still hold the process
