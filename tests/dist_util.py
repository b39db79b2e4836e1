"""Run N ranks as local processes (gloo on CPU), bounded by a timeout: a hang fails, never freezes CI."""
import os
import socket
import subprocess
import sys
import time

from conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu", "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra or {})
    return env


def run_plan(tmp_path, plan, name: str, worker: str, *args: str, timeout: float = 150) -> list:
    """Write ``plan`` to ``name``.json, run ``worker PLAN OUT *args`` on every rank (each saves its results to
    OUT with {rank} filled in), and return what each rank saved."""
    import torch
    path = str(tmp_path / f"{name}.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    out = str(tmp_path / f"{name}{{rank}}.pt")
    for rank, (rc, _o, err) in enumerate(spawn(plan.world_size, [worker, path, out, *args], timeout=timeout)):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"
    return [torch.load(out.replace("{rank}", str(r)), weights_only=True) for r in range(plan.world_size)]


def spawn(world: int, argv: list[str], timeout: float = 90, extra_env: dict | None = None):
    """Start ``world`` ranks of ``python argv``; returns [(returncode, stdout, stderr)] per rank."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *argv], env=rank_env(r, world, port, extra_env), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
        raise AssertionError(f"ranks still running after {timeout} s (hang?):\n"
                             + "\n".join(f"--- rank {r}\n{o[1][-2000:]}" for r, o in enumerate(outs)))
    return results


def wait_for_line(stream, pattern: str, timeout: float) -> str:
    """Block until a line of ``stream`` (a text pipe) matches ``pattern``: an event, not a sleep-and-poll.
    Fails on end of stream or after ``timeout`` seconds."""
    import re
    import select
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([stream], [], [], max(0.0, left))
        if not ready:
            raise AssertionError(f"no line matching {pattern!r} within {timeout} s")
        line = stream.readline()
        if not line:
            raise AssertionError(f"stream ended before a line matching {pattern!r}")
        if re.search(pattern, line):
            return line
