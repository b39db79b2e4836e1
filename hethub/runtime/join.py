"""The join: every rank of the plan reaches rank 0's store before the world is made, bounded by its own timeout.

Why its own: torch's ``env://`` rendezvous waits for the other ranks with the world's collective timeout
(``hetero.timeout_s``), which bounds how long a rank waits for a lost peer once training runs. Ranks do not start
together: hosts are launched by hand or by ssh one after another, and ranks import torch and DeepSpeed at
different speeds on a loaded host. A timeout tuned to notice a lost peer in seconds then fails the start with
torch's traceback on every host, naming nobody. Here the join waits up to ``hetero.join_timeout_s``, rank 0 says
whom it waits for (by host, from the plan), and a rank that never comes ends every rank that did with one line
naming it. The world is then made on this store (``init_process_group(store=...)``), so the rank's collectives
keep ``timeout_s``.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Optional, Sequence

import torch.distributed as dist

from ..partitioner.errors import print_error
from ..partitioner.outputs import count

WAIT_NOTE_S = 10.0  # rank 0 says whom it waits for once the join has taken this long
_POLL_S = 0.5
_COUNT = "hethub/joined-count"  # ranks that joined (the one key every rank polls)
_ENDED = "hethub/join-ended"  # rank 0's line when the join failed
_GRACE_S = 30.0  # a rank whose rank 0 said nothing this long after the join timeout stops waiting for it


def _key(rank: int) -> str:
    return f"hethub/joined/{rank}"


def _ranges(ranks: Sequence[int]) -> str:
    """``0, 2-4, 7``: the ranks in short."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _missing_note(missing: Sequence[int], hosts: Optional[Sequence[str]]) -> str:
    where = sorted({hosts[r] for r in missing}) if hosts else []
    on = f" (host {', '.join(where[:8])}{', ...' if len(where) > 8 else ''})" if where else ""
    return f"rank(s) {_ranges(missing)}{on}"


def _end(rank: int, message: str) -> None:
    print_error(f"rank {rank}: {message}")
    os._exit(3)  # as a lost peer ends a rank (errors.Guard.lost): the store's threads may still hold the process


def _wait_for_port(addr: str, port: int, deadline: float, rank: int, join_timeout_s: float) -> None:
    """Rank 0's store accepts connections (polled quietly: torch's own client logs a C++ trace per retry)."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                _end(rank, f"rank 0's store at {addr}:{port} did not answer within hetero.join_timeout_s = "
                           f"{join_timeout_s:g} s ({exc.strerror or exc}): is `hethub launch` running on rank 0's "
                           f"host, with the same --master_addr and --master_port?")
            time.sleep(_POLL_S)


def open_store(rank: int, world_size: int, addr: str, port: int, join_timeout_s: float) -> dist.TCPStore:
    """Rank 0 serves the store; the others connect to it, waiting up to ``join_timeout_s`` for it to come up."""
    deadline = time.monotonic() + join_timeout_s
    timeout = datetime.timedelta(seconds=join_timeout_s)
    if rank != 0:
        _wait_for_port(addr, port, deadline, rank, join_timeout_s)
    try:
        return dist.TCPStore(addr, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    except dist.DistError as exc:
        what = "listen on" if rank == 0 else "connect to"
        _end(rank, f"cannot {what} the store at {addr}:{port}: {str(exc).splitlines()[0][:160]}"
                   f"{' (another run on this host? give --master_port another port)' if rank == 0 else ''}")
        raise  # unreachable: _end exits


def join(store: dist.Store, rank: int, world_size: int, join_timeout_s: float,
         hosts: Optional[Sequence[str]] = None) -> None:
    """This rank has joined; returns once every rank has, or ends this rank with one line naming those that did
    not. ``hosts``: each rank's host in the plan (named in the lines), if known.

    Rank 0 decides when the join has failed and says so through the store (``_ENDED``), so that every rank that
    joined ends with the same line before rank 0, and its store, are gone."""
    store.set(_key(rank), socket.gethostname())  # who joined: named when some did not
    store.add(_COUNT, 1)
    start = time.monotonic()
    noted = False
    try:
        # a counter polled (one small request a rank every half second, whatever the world's size), not a timed
        # wait on every rank's key: that logs a C++ warning at each timeout and costs the store O(world) a poll
        while store.add(_COUNT, 0) < world_size:
            waited_s = time.monotonic() - start
            if rank != 0:
                _follow(store, rank, waited_s, join_timeout_s)
            elif waited_s >= join_timeout_s:
                _fail_join(store, world_size, join_timeout_s, hosts)
            elif not noted and waited_s >= WAIT_NOTE_S:
                noted = _note(store, world_size, join_timeout_s, hosts)
            time.sleep(_POLL_S)
    except dist.DistError as exc:  # rank 0, and its store, went away
        _end(rank, f"lost rank 0 while the ranks joined: {str(exc).splitlines()[0][:160]}")


def _missing(store: dist.Store, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([_key(r)])]


def _note(store: dist.Store, world_size: int, join_timeout_s: float, hosts: Optional[Sequence[str]]) -> bool:
    """Rank 0 says whom it waits for, once ranks of another host are missing (True: said). Ranks of its own host
    were started by its own launcher and are only importing (a loaded host takes tens of seconds): no note."""
    missing = _missing(store, world_size)
    if not hosts or all(hosts[r] == hosts[0] for r in missing):
        return False
    print(f"hethub: {count(world_size - len(missing), 'rank')} of {world_size} joined; waiting up to "
          f"{join_timeout_s:g} s (hetero.join_timeout_s) for {_missing_note(missing, hosts)}",
          file=sys.stderr, flush=True)
    return True


def _fail_join(store: dist.Store, world_size: int, join_timeout_s: float, hosts: Optional[Sequence[str]]) -> None:
    """Rank 0: tell every rank that joined why the run ends, give them a moment to read it, end."""
    message = (f"{_missing_note(_missing(store, world_size), hosts)} did not join within hetero.join_timeout_s = "
               f"{join_timeout_s:g} s: start `hethub launch` on every host of the plan, with the same --master_addr "
               f"and --master_port")
    store.set(_ENDED, message)
    print_error(f"rank 0: {message}")  # now: the launcher ends this rank once another has ended
    deadline = time.monotonic() + 5.0
    joined = [r for r in range(1, world_size) if store.check([_key(r)])]
    while time.monotonic() < deadline and not all(store.check([f"{_ENDED}/{r}"]) for r in joined):
        time.sleep(_POLL_S)
    os._exit(3)


def _follow(store: dist.Store, rank: int, waited_s: float, join_timeout_s: float) -> None:
    """A rank other than 0: end with rank 0's line once it says the join failed."""
    if store.check([_ENDED]):
        message = store.get(_ENDED).decode()
        store.set(f"{_ENDED}/{rank}", "read")
        _end(rank, message)
    if waited_s >= join_timeout_s + _GRACE_S:
        _end(rank, f"not every rank joined within hetero.join_timeout_s = {join_timeout_s:g} s, and rank 0 said "
                   f"nothing for {_GRACE_S:g} s more")
