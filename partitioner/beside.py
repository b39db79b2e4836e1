"""Work that runs beside the main search, in a forked process of its own, and hands back JSON.

Why: ``plan`` compares its plan with each device type alone (the homogeneous sum, the fastest-only baseline) and
with DeepSpeed's partitions. Run after the search, those took 9 s on 768 devices at ``--time-limit 10``: the
command took twice its limit. They need nothing from the main search, so on a second core they run during it.
Where there is no second core or no ``fork`` (Windows), the work runs in this process when its result is asked
for: the same result, later (on one core, two searches at once would each get half of their time limits).
Forking is used on Linux only (``can_run_beside``).

The child ignores Ctrl-C (the parent says the one line and ends it; the signal is held back across the fork),
writes nothing but its JSON to a pipe, and leaves by ``os._exit``: no buffers or exit handlers inherited from the parent run twice."""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from typing import Any, Callable, Optional

from .errors import InputError

# The parent waits this long past the work's own time budget before it gives up on the child (a search may
# overrun its limit by its replays; a hang is a bug, and must end in one line, not a frozen command).
GRACE_S = 60.0


def cores() -> int:
    """The cores this process may run on (its affinity where the OS says, e.g. under taskset or a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity call
        return os.cpu_count() or 1


def can_run_beside() -> bool:
    """Linux with a second core. Elsewhere the work runs after the search: macOS's system libraries (numpy's
    Accelerate among them) are not safe to use in a child forked from a process with threads."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and cores() >= 2


class Beside:
    """``work()`` (returning JSON-able data) started now in a forked child where ``concurrent`` (default: where
    ``can_run_beside``); ``result()`` waits for it, at most ``budget_s`` + GRACE_S from the start. An
    ``InputError`` raised by the work is raised again, as itself, by ``result()``; any other failure is a
    ``RuntimeError`` naming it. Use as a context manager: leaving ends the child if it still runs."""

    def __init__(self, work: Callable[[], Any], budget_s: float, concurrent: Optional[bool] = None):
        self._work, self._budget_s = work, budget_s
        self._pid: Optional[int] = None
        self._fd: Optional[int] = None
        self._have, self._value = False, None
        if can_run_beside() if concurrent is None else concurrent:
            try:
                self._start()
            except BaseException:  # Ctrl-C as the child started: it goes too (no ``with`` holds it yet)
                self.close()
                raise

    @property
    def concurrent(self) -> bool:
        return self._pid is not None

    def __enter__(self) -> "Beside":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        sys.stdout.flush()  # nothing buffered before the fork may be written by both processes
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        self._started = time.monotonic()
        # Ctrl-C held back across the fork: landing in the child before it ignores it, it would run on as a second
        # copy of the command; held, it reaches the parent once the child is known (and ended by ``close``)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            pid = os.fork()
            if pid == 0:  # the child: never returns
                try:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent says the one line and ends this one
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                    os.close(read_fd)
                    _child(self._work, write_fd)
                finally:
                    os._exit(1)
            os.close(write_fd)
            self._pid, self._fd = pid, read_fd
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def result(self) -> Any:
        if not self._have:
            self._value = self._collect() if self._pid is not None else self._work()
            self._have = True
        return self._value

    def _collect(self) -> Any:
        chunks, deadline = [], self._started + self._budget_s + GRACE_S
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the comparisons' process gave no answer within {self._budget_s + GRACE_S:g} s "
                                       "(`plan --no-compare` skips them)")
                if select.select([self._fd], [], [], left)[0]:
                    chunk = os.read(self._fd, 1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
        finally:
            self.close()
        payload = json.loads(b"".join(chunks) or b'{"error": "it ended without an answer"}')
        if "input_error" in payload:
            raise InputError(*payload["input_error"])
        if "error" in payload:
            raise RuntimeError(f"the comparisons' process failed: {payload['error']}")
        return payload["value"]

    def close(self) -> None:
        """End the child (if it still runs) and reap it; idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._pid is not None:
            pid, self._pid = self._pid, None
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _child(work: Callable[[], Any], fd: int) -> None:
    code = 0
    try:
        payload: dict = {"value": work()}
    except InputError as exc:
        payload, code = {"input_error": [exc.field, exc.message]}, 0
    except BaseException as exc:  # any other failure goes back to the parent, which names it
        payload, code = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}, 1
    try:
        data = json.dumps(payload).encode()
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # the parent is gone (it was interrupted, or ended): nobody to answer
        code = 1
    finally:
        os._exit(code)
