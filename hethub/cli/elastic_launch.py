"""``hethub launch --elastic``: one per host, on torch's elastic agent (torchrun's c10d rendezvous).

    hethub launch --elastic --hetero-plan plan.json --master_addr ADDR --master_port PORT --checkpoint-dir DIR
        --checkpoint-every N [--min-nodes K] [--max-restarts R] [--join-timeout S] [--log-json FILE] [--host NAME]
        train.py [script args]

Why torch's agent and not a protocol of our own: it already restarts every worker of the job when a host is lost
(its workers' collectives fail) or joins (a node waits in the rendezvous), keeps a restart budget, and gives up
on a host that stops answering. What it cannot do is re-plan: its workers restart with the same script, so each
hethub worker re-plans at ``hethub.initialize`` for the hosts present (``hethub.runtime.elastic``), from what this
launcher hands it: its host (``HETHUB_HOST``), the checkpoint directory and interval.

The plan's cluster names every host that may take part; this machine is the one whose name or address matches
(``--host`` says which otherwise). Its agent starts one worker per device the cluster gives it. ADDR:PORT is the
rendezvous, held by the agent on ADDR.

The job ends with one line, on every host: when a worker ends on bad input (exit 2: the hosts left cannot hold the
model, a checkpoint cannot be written...), which no restart fixes (the worker leaves the line in
``DIR/plans/.stop`` and each launcher stops its agent); when fewer than K hosts are in the rendezvous for S seconds;
when the workers failed more than R times.
"""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..partitioner.errors import InputError
from ..partitioner.records import Plan, check_host, load_plan
from ..events import EVENTS_ENV, log_event, read_stop, stop_path

# flag -> (kind, default); None: required
FLAGS = {"--master_addr": (str, None), "--master_port": (int, None), "--checkpoint-dir": (str, None),
         "--checkpoint-every": (int, None), "--min-nodes": (int, 1), "--max-restarts": (int, 3),
         "--join-timeout": (int, 120), "--log-json": (str, ""), "--host": (str, "")}
MAX_RESTARTS = 1000
MAX_JOIN_TIMEOUT_S = 7 * 86400
WATCH_S = 0.5  # how often the launcher looks for a worker's request to end the job
# torch's rendezvous: wait this long for more hosts once the minimum is there (its default, 30 s, is most of the
# time a loss may cost); give up on a host that stopped answering after about 3 x its keep-alive interval
LAST_CALL_S, KEEP_ALIVE_S = 2, 2


@dataclass(frozen=True)
class ElasticLaunch:
    plan_path: str
    plan: Plan
    host: str
    nproc: int
    master_addr: str
    master_port: int
    checkpoint_dir: str
    checkpoint_every: int
    min_nodes: int
    max_restarts: int
    join_timeout_s: int  # the rendezvous gives up when fewer than min_nodes hosts are in it this long
    log_json: str  # events as JSON lines, appended ("" none)
    script: list[str]  # the script and its arguments
    holds_rendezvous: bool  # this host is ADDR: its agent holds the rendezvous' store


def parse(plan_path: str, rest: Sequence[str], is_this_host: Callable[[str], bool]) -> ElasticLaunch:
    """The flags after ``--elastic`` up to the script, each checked (one line naming the flag). ``is_this_host``
    tells the plan's host this machine is (``hethub.cli.launch``'s rule) where ``--host`` does not."""
    values, i, rest = {}, 0, list(rest)
    while i < len(rest) and rest[i].startswith("--"):
        name, eq, value = rest[i].partition("=")
        if name not in FLAGS:
            raise InputError(name[:60], f"is not a flag of launch --elastic (its flags: {', '.join(FLAGS)})")
        if not eq:
            if i + 1 >= len(rest):
                raise InputError(name, "expects a value")
            value, i = rest[i + 1], i + 1
        kind = FLAGS[name][0]
        try:
            values[name] = kind(value)
        except ValueError:
            raise InputError(name, f"expects {'an integer' if kind is int else 'a value'}, got {value[:60]!r}") from None
        i += 1
    missing = [f for f, (_k, default) in FLAGS.items() if default is None and f not in values]
    if missing:
        raise InputError(missing[0], "is required by launch --elastic")
    if i >= len(rest):
        raise InputError("launch", "no training script given after launch --elastic's flags")
    plan = load_plan(plan_path)
    return _checked(plan_path, plan, {f: values.get(f, default) for f, (_k, default) in FLAGS.items()}, rest[i:],
                    is_this_host)


def _checked(plan_path: str, plan: Plan, v: dict, script: list[str], is_this_host) -> ElasticLaunch:
    hosts = plan.cluster.hosts
    if not 1 <= v["--master_port"] <= 65535:
        raise InputError("--master_port", f"must be in 1..65535, got {v['--master_port']}")
    try:
        check_host(v["--master_addr"])
    except ValueError as exc:
        raise InputError("--master_addr", str(exc)) from None
    if v["--checkpoint-every"] < 1:
        raise InputError("--checkpoint-every", f"must be at least 1 (steps), got {v['--checkpoint-every']}")
    if not 1 <= v["--min-nodes"] <= len(hosts):
        raise InputError("--min-nodes", f"must be in 1..{len(hosts)} (the plan's cluster has {len(hosts)} "
                                        f"hosts), got {v['--min-nodes']}")
    if not 0 <= v["--max-restarts"] <= MAX_RESTARTS:
        raise InputError("--max-restarts", f"must be in 0..{MAX_RESTARTS}, got {v['--max-restarts']}")
    if not 1 <= v["--join-timeout"] <= MAX_JOIN_TIMEOUT_S:
        raise InputError("--join-timeout", f"must be in 1..{MAX_JOIN_TIMEOUT_S} (seconds), got {v['--join-timeout']}")
    host = v["--host"] or _this_host(hosts, is_this_host)
    if host not in hosts:
        raise InputError("--host", f"{host[:80]!r} is not a host of the plan's cluster ({', '.join(hosts)[:200]})")
    nproc = sum(n.count for n in plan.cluster.nodes if n.host == host)
    return ElasticLaunch(os.path.abspath(plan_path), plan, host, nproc, v["--master_addr"], v["--master_port"],
                         os.path.abspath(v["--checkpoint-dir"]), v["--checkpoint-every"], v["--min-nodes"],
                         v["--max-restarts"], v["--join-timeout"],
                         os.path.abspath(v["--log-json"]) if v["--log-json"] else "", script,
                         host == v["--master_addr"] or is_this_host(v["--master_addr"]))


def _this_host(hosts: list[str], is_this_host) -> str:
    found = [h for h in hosts if is_this_host(h)]
    if len(found) != 1:
        raise InputError("--host", f"this machine ({socket.gethostname()[:60]!r}) is {len(found)} of the plan's "
                                   f"hosts ({', '.join(hosts)[:200]}): say which with --host NAME")
    return found[0]


def command(el: ElasticLaunch) -> tuple[list[str], dict]:
    """torchrun's command line and the workers' environment."""
    job = hashlib.sha256(el.plan.to_json().encode()).hexdigest()[:12]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{el.min_nodes}:{len(el.plan.cluster.hosts)}",
           "--nproc-per-node", str(el.nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{el.master_addr}:{el.master_port}", "--rdzv-id", f"hethub-{job}",
           "--rdzv-conf", f"last_call_timeout={LAST_CALL_S},keep_alive_interval={KEEP_ALIVE_S},"
                          f"join_timeout={el.join_timeout_s},"
                          f"is_host={int(el.holds_rendezvous)}",  # torch guesses it from DNS names, not addresses
           "--max-restarts", str(el.max_restarts), "--monitor-interval", "1"]
    if _is_address(el.host):  # the address other hosts reach this one at (a name would need DNS)
        cmd += ["--local-addr", el.host]
    cmd += [el.script[0], "--hetero-plan", el.plan_path, *el.script[1:]]
    env = dict(os.environ, HETHUB_ELASTIC="1", HETHUB_HOST=el.host, HETHUB_CHECKPOINT_DIR=el.checkpoint_dir,
               HETHUB_CHECKPOINT_EVERY=str(el.checkpoint_every),
               # Each round's rank 0 publishes the workers' master address: with the agent's store shared (torch's
               # default) a rank 0 that stays rank 0 publishes it only in its first round, and a host that joins
               # later waits for it forever (seen with torch 2.13 when the lost host comes back)
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if el.log_json:
        env[EVENTS_ENV] = el.log_json
    return cmd, env


def _is_address(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            continue
    return False


def run(el: ElasticLaunch, dry_run: bool = False) -> int:
    """torchrun on this host, in a session of its own, watched until the job ends; the reason in one line."""
    cmd, env = command(el)
    if dry_run:
        print(" ".join(cmd))
        print(f"# environment: HETHUB_ELASTIC=1 HETHUB_HOST={el.host} HETHUB_CHECKPOINT_DIR={el.checkpoint_dir} "
              f"HETHUB_CHECKPOINT_EVERY={el.checkpoint_every}" + (f" {EVENTS_ENV}={el.log_json}" if el.log_json else ""))
        return 0
    os.makedirs(el.checkpoint_dir, exist_ok=True)
    stop = stop_path(el.checkpoint_dir)
    if os.path.exists(stop):  # an earlier job's end: this start is a new job
        os.remove(stop)
    print(f"hethub: elastic launch on {el.host} ({el.nproc} workers), rendezvous {el.master_addr}:{el.master_port}, "
          f"at least {el.min_nodes} of {len(el.plan.cluster.hosts)} hosts; checkpoints every "
          f"{el.checkpoint_every} steps in {el.checkpoint_dir}", flush=True)
    rc, stopped, timed_out = _supervise(cmd, env, stop)
    if rc == 0:
        return 0
    kept = f"the newest complete checkpoint in {el.checkpoint_dir} is kept"
    if stopped is not None:
        why, rc = f"a worker ended on input no restart can fix: {stopped}", 2
    elif timed_out:
        why, rc = (f"fewer than --min-nodes {el.min_nodes} of the plan's {len(el.plan.cluster.hosts)} hosts were in "
                   f"the rendezvous for --join-timeout {el.join_timeout_s} s"), 2
    else:
        why = f"its workers failed after --max-restarts {el.max_restarts} restarts (exit {rc}; see above)"
    sys.stderr.write(f"error: launch --elastic: the job ended on {el.host}: {why}; {kept}\n")
    sys.stderr.flush()
    log_event(el.log_json, "ended", host=el.host, exit=rc, reason=why)
    return rc


def _supervise(cmd: list[str], env: dict, stop: str) -> tuple[int, Optional[str], bool]:
    """Run torchrun until it ends or a worker asks (``stop``) for the job to end; its stderr passes through, watched
    for the rendezvous giving up. (exit code, the worker's line if it asked, whether the rendezvous timed out)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    seen = {"timeout": False, "quiet": False}
    reader = threading.Thread(target=_pass_through, args=(proc.stderr, seen), daemon=True)
    reader.start()
    stopped = None
    try:
        while proc.poll() is None:
            time.sleep(WATCH_S)
            if stopped is None and os.path.exists(stop):
                stopped = read_stop(stop)
                seen["quiet"] = True  # the agent's traceback for the signal below says nothing the line won't
                os.killpg(proc.pid, signal.SIGTERM)  # the agent ends its workers
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        rc = 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=5)
    return rc, stopped, seen["timeout"]


def _pass_through(stream, seen: dict) -> None:
    for line in iter(stream.readline, b""):
        if not seen["quiet"]:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
        if b"RendezvousTimeoutError" in line:
            seen["timeout"] = True

