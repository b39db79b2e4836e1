"""Run N ranks as local processes (gloo on CPU), bounded by a timeout: a hang fails, never freezes CI."""
import itertools
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from conftest import ROOT


# Each xdist worker hands out ports from a block of its own, below the kernel's ephemeral range (32768-60999 on
# Linux), where bind(0) and outgoing connections take theirs: bound to port 0, two workers were handed the same
# port seconds apart, and a rank's store failed to listen (EADDRINUSE) while its peers waited out the timeout.
PORT_BASE, PORT_BLOCK = 20000, 1500
_ports = itertools.count()


def free_port() -> int:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    for _ in range(PORT_BLOCK):
        port = PORT_BASE + (worker % 8) * PORT_BLOCK + next(_ports) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (a run still holding it, or another program): the next one
                continue
            return port
    raise AssertionError(f"no free port in worker {worker}'s block of {PORT_BLOCK}")


def run_deepspeed(num_gpus: int, args: list, **kw) -> subprocess.CompletedProcess:
    """DeepSpeed's own launcher (``--num_gpus N --master_port P args``) run to the end, then the shared-memory
    buffers its CPU ranks leave behind removed: DeepSpeed's CPU backend creates a 66 MB
    ``/dev/shm/deepspeed_allreduce_buffer_<rank>_<addr>_<port>_<n>`` per rank of a world it starts itself (hethub's
    world start skips that op) and never unlinks it; suite after suite they filled a 24 GiB machine's memory. The
    tests' Pythons now skip that op too (``tests/site``); the sweep stays for a run started without that folder."""
    port = free_port()
    try:
        return subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus),
                               "--master_port", str(port), *args], **kw)
    finally:
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
            if name.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in name:
                os.unlink(os.path.join("/dev/shm", name))


def one_process(args: list, extra_env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script *args`` as the one rank of a world of one, as ``deepspeed --num_gpus 1`` starts it (its rank
    variables and ``--local_rank=0`` after the script), from the ranks' fork server: a one-process reference
    without the runner and per-node launcher, two interpreters that imported torch and DeepSpeed only to start
    it (about 5 s of CPU a reference on 2 cores)."""
    (rc, out, err), = spawn(1, [args[0], "--local_rank=0", *args[1:]], timeout=timeout, extra_env=extra_env)
    return subprocess.CompletedProcess(args, rc, out, err)


def child_env() -> dict:
    """This process's environment for a child on CPU: one thread, DeepSpeed's CPU accelerator, the repository
    importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def rank_env(rank: int, world: int, port: int, extra: dict | None = None) -> dict:
    env = child_env()
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
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


# Ranks start from a fork server that has already imported torch, torch._dynamo (which the first optimizer
# imports) and DeepSpeed: each rank then costs its own work, not ~4 s of imports, which on 2 cores was most of
# the multi-process tests' time. HETHUB_TEST_EXEC=1 starts every rank as a fresh interpreter instead.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor", "deepspeed", "hethub.runtime",
            # Hugging Face's GPT-2 and Llama (where transformers is installed; a missing module is skipped): about
            # 2.5 s of CPU for each Hugging Face rank on 2 cores, paid once per worker instead
            "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama", "hethub.models.hf"]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        import multiprocessing
        # what the preloaded imports read from the environment, fixed before the server starts
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _rank_main(argv: list[str], env: dict, out_path: str, err_path: str) -> None:
    """A rank in a forked child: the environment, argv and stdout/stderr a fresh ``python argv`` would have, and
    its end too: an interpreter runs the ``atexit`` hooks (hethub's exit barrier, a checkpoint finishing its
    write) after the script or its uncaught exception, which a multiprocessing child skips (it leaves through
    ``os._exit``)."""
    import atexit
    try:
        _run_script(argv, env, out_path, err_path)
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())  # printed before the hooks run, as an interpreter does
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()


def _run_script(argv: list[str], env: dict, out_path: str, err_path: str) -> None:
    import runpy
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, ROOT)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


# Reading a forkserver child's exit code consumes it: a second reader gets EOF and sets the code to 255. Every
# Process.start() polls all live children, so tests that spawn from several threads (the shutdown test) must
# read exit codes one thread at a time (CPython gh-130895).
_REAP = threading.Lock()


def _join(p, timeout: float | None) -> None:
    """``p.join(timeout)`` safe beside other threads' spawns: wait on the sentinel unlocked, read the code locked."""
    from multiprocessing.connection import wait
    wait([p.sentinel], timeout)
    with _REAP:
        p.join(0)


def spawn(world: int, argv: list[str], timeout: float = 90, extra_env: dict | None = None):
    """Start ``world`` ranks of ``python argv``; returns [(returncode, stdout, stderr)] per rank."""
    if os.environ.get("HETHUB_TEST_EXEC") == "1":
        return _spawn_exec(world, argv, timeout, extra_env)
    port = free_port()
    return _forked(argv, [rank_env(r, world, port, extra_env) for r in range(world)], timeout)


def run_python(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python argv`` in one child of the ranks' fork server, outside any world (no rank variables), run to
    its end: the one-process references of the equivalence tests, each of which was a fresh interpreter
    importing torch, torch._dynamo and DeepSpeed (about 3 s of CPU apiece, some 60 of them a suite)."""
    env = child_env()
    if os.environ.get("HETHUB_TEST_EXEC") == "1":
        return subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    (rc, out, err), = _forked(argv, [env], timeout)
    return subprocess.CompletedProcess(argv, rc, out, err)


def _forked(argv: list[str], envs: list[dict], timeout: float) -> list:
    """One forked child per environment in ``envs``, each running ``python argv``; [(returncode, stdout,
    stderr)] each, or an AssertionError naming the ones still running after ``timeout`` seconds."""
    import tempfile
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="hethub-ranks-")
    paths = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(len(envs))]
    procs = [ctx.Process(target=_rank_main, args=(argv, env, *paths[r])) for r, env in enumerate(envs)]
    with _REAP:
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        _join(p, max(0.0, deadline - time.monotonic()))
    with _REAP:
        hung = any(p.exitcode is None for p in procs)
        for p in procs:
            if p.exitcode is None:
                p.kill()
    for p in procs:
        _join(p, None)
    results = []
    for p, (out, err) in zip(procs, paths):
        with open(out, errors="replace") as fo, open(err, errors="replace") as fe:
            results.append((p.exitcode, fo.read(), fe.read()))
    shutil.rmtree(tmp, ignore_errors=True)
    if hung:
        raise AssertionError(f"ranks still running after {timeout} s (hang?):\n"
                             + "\n".join(f"--- rank {r}\n{o[2][-2000:]}" for r, o in enumerate(results)))
    return results


def _spawn_exec(world: int, argv: list[str], timeout: float, extra_env: dict | None):
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
