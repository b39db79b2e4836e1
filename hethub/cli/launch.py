"""``hethub launch``: the drop-in for ``deepspeed --hetero-plan plan.json train.py``.

DeepSpeed's runner has a fixed argument parser and no plugin hook, so hethub builds the argument
list itself: it checks the plan, writes a hostfile (hosts in the order the plan's ranks use them)
and an ``--include`` list (each host's slots) under which DeepSpeed numbers ranks exactly as the
plan does, passes every other flag through unchanged, hands ``--hetero-plan`` to the script, and
runs DeepSpeed's launcher. ``--local`` runs every rank on this machine (emulated clusters, tests).
On several hosts DeepSpeed starts them over pdsh; without ssh, run it on every host with ``--no_ssh
--master_addr ADDR`` (node 0's address) and ``--node_rank K``, or none: the plan's host that is this
machine (by host name or address) gives it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Sequence

from . import elastic_launch
from ..dsconfig import check_config, load_config
from ..partitioner.errors import InputError, missing_package
from ..partitioner.outputs import count
from ..partitioner.records import Plan, load_plan

# deepspeed flags that place ranks: the plan decides these
_PLACEMENT_FLAGS = ("--hostfile", "-H", "--include", "-i", "--exclude", "-e", "--num_nodes", "--num_gpus",
                    "--num_accelerators")


def host_layout(plan: Plan) -> list[tuple[str, list[int]]]:
    """[(host, slots)] in rank order; refuses plans whose ranks DeepSpeed's launcher cannot reproduce."""
    by_rank = sorted((rank, r.host, slot) for s in plan.stages for r in s.replicas
                     for rank, slot in zip(s.ranks_of(r), s.slots_of(r)))
    layout: list[tuple[str, list[int]]] = []
    for rank, host, slot in by_rank:
        if layout and layout[-1][0] == host:
            if slot <= layout[-1][1][-1]:
                raise InputError("plan.stages", f"rank {rank} on {host}:{slot} comes after slot {layout[-1][1][-1]}: "
                                                "DeepSpeed's launcher numbers a host's ranks by ascending slot; "
                                                "re-plan with `hethub plan`")
            layout[-1][1].append(slot)
        else:
            if any(h == host for h, _ in layout):
                raise InputError("plan.stages", f"rank {rank} returns to host {host!r} after other hosts: DeepSpeed's "
                                                "launcher needs each host's ranks contiguous; re-plan with "
                                                "`hethub plan`")
            layout.append((host, [slot]))
    return layout


def hostfile_text(plan: Plan) -> str:
    return "".join(f"{host} slots={plan.cluster.host_count(host)}\n" for host, _ in host_layout(plan))


def include_arg(plan: Plan) -> str:
    return "@".join(f"{host}:{','.join(map(str, slots))}" for host, slots in host_layout(plan))


def split_script(rest: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """(deepspeed launcher flags, script, script args): the script is the first token DeepSpeed's parser
    would take as ``user_script``."""
    ns = parse_deepspeed_flags(list(rest))
    for i, tok in enumerate(rest):
        if tok == ns.user_script and list(rest[i + 1:]) == list(ns.user_args):
            return list(rest[:i]), tok, list(rest[i + 1:])
    raise InputError("launch", "no training script given")


def parse_deepspeed_flags(args: list[str]):
    """DeepSpeed's runner parser on ``args``; its usage text and error become one line (hethub's own flags
    must come first, and a misplaced one is the usual cause). Where DeepSpeed is not installed (a planning
    laptop's dry run; ``run`` refuses a real launch there first), ``_plain_flags`` stands in. Where the only
    launcher flags are ones hethub itself adds, written ``--name=value`` (most launches), the parse is plain too,
    as DeepSpeed's would be: importing DeepSpeed here costs ~2 s of CPU a launch, paid again by its runner."""
    flags = list(itertools.takewhile(lambda a: a.startswith("-"), args))
    if len(flags) < len(args) and all(f.partition("=")[0] in _OWN_FLAGS and "=" in f for f in flags):
        return _plain_flags(args)
    try:
        from deepspeed.launcher import runner  # lazy: a planning-only install has no DeepSpeed (one line below)
    except ImportError:
        return _plain_flags(args)
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            return runner.parse_args(args)
    except SystemExit:
        said = usage.getvalue().strip().splitlines()
        why = said[-1].partition("error: ")[2] if said else "cannot parse the flags"
        if why.startswith("unrecognized arguments"):
            why += " (hethub launch's own flags --local, --resume, --dry-run come before deepspeed's)"
        raise InputError("launch", f"deepspeed's launcher: {why}") from None


def _plain_flags(args: list[str]) -> argparse.Namespace:
    """``parse_deepspeed_flags`` without DeepSpeed: launcher flags written ``--name=value`` (or none), then the
    script; ``--name value`` cannot be told from a script without DeepSpeed's parser, so it is one line."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if "=" not in args[i]:
            raise missing_package(f"launch {args[i][:40]}", "deepspeed")
        i += 1
    if i == len(args):
        raise InputError("launch", "no training script given")
    values = dict(a[2:].partition("=")[::2] for a in args[:i])
    return argparse.Namespace(user_script=args[i], user_args=args[i + 1:], no_ssh=False,
                              launcher=values.get("launcher", "pdsh"), master_addr=values.get("master_addr", ""),
                              node_rank=-1)


def build_command(plan_path: str, plan: Plan, rest: Sequence[str], local: bool, hostfile_path: str,
                  dry_run: bool = False) -> tuple[list[str], dict]:
    flags, script, script_args = split_script(rest)
    for f in flags:
        if f.split("=")[0] in _PLACEMENT_FLAGS:
            raise InputError(f.split("=")[0], "the plan places every rank; drop this launcher flag "
                                              "(or use `deepspeed` directly with a hostfile matching the plan)")
    if any(a == "--hetero-plan" or a.startswith("--hetero-plan=") for a in script_args):
        raise InputError("--hetero-plan", "give it once, before the script (hethub launch passes it on)")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # DeepSpeed's launcher leaves it unset: N ranks x all cores
    if local:
        placement = ["--num_gpus", str(plan.world_size)]
        env["HETHUB_LOCAL"] = "1"
        if not any(f.startswith("--master_port") for f in flags):
            placement += ["--master_port", str(_free_port())]
    else:
        placement = ["--hostfile", hostfile_path, "--include", include_arg(plan),
                     *host_flags(plan, flags, script, dry_run)]
        if not dry_run:  # a dry run writes nothing: it prints the hostfile's lines instead
            with open(hostfile_path, "w", encoding="utf-8") as f:
                f.write(hostfile_text(plan))
    # every rank starts through hethub's entry point, which takes the plan and routes deepspeed.initialize to
    # hethub before running the script unchanged (its own arguments untouched)
    names = [f.split("=")[0] for f in flags]
    if "--no_python" in names or "--no-python" in names:
        raise InputError("--no_python", "hethub launch starts each rank through a Python entry point that routes "
                                        "DeepSpeed to the plan; run a Python script or module")
    module = "--module" in names or "-m" in names
    flags = [f for f in flags if f.split("=")[0] not in ("--module", "-m")]
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *flags, *placement, "--module",
           "hethub.cli.rank_entry", "--hetero-plan", plan_path, *(["--module"] if module else []), script,
           *script_args]
    return cmd, env


def host_flags(plan: Plan, flags: Sequence[str], script: str, dry_run: bool = False) -> list[str]:
    """Launcher flags a plan on several hosts still needs, or one line saying why the launch could not start.

    Why: on several hosts DeepSpeed's runner either starts every host over pdsh/ssh, or (``--no_ssh``)
    starts only this host's ranks and must be told which host this is and where node 0 listens. Left
    to it, a missing pdsh, ``--node_rank`` or ``--master_addr`` ends in a traceback (or an ssh attempt)
    after the script has been handed over; here each is a line naming the flag, before anything starts.
    ``--node_rank`` may be left out: the plan's host that is this machine (``is_this_host``) gives it. A dry run
    shows the command even where pdsh is missing (it may be planned on another machine).
    """
    hosts = [h for h, _ in host_layout(plan)]
    if len(hosts) == 1 and is_this_host(hosts[0]):
        return []
    ns = parse_deepspeed_flags([*flags, script])
    names = ", ".join(f"{k} = {h!r}" for k, h in enumerate(hosts))
    if not ns.no_ssh:
        if ns.launcher.lower() == "pdsh" and shutil.which("pdsh") is None and not dry_run:
            where = (f"the plan spans {len(hosts)} hosts" if len(hosts) > 1 else
                     f"the plan's one host {hosts[0]!r} is not this machine (--local runs every rank here)")
            raise InputError("launch", f"{where} and DeepSpeed's pdsh launcher is not installed: install pdsh, or on "
                                       "each host run `hethub launch --hetero-plan PLAN --no_ssh --master_addr ADDR "
                                       "...` (node ranks: " + names + ")")
        return []
    if not ns.master_addr:
        raise InputError("--master_addr", f"--no_ssh needs the address of node 0, host {hosts[0]!r}")
    if ns.node_rank >= len(hosts) or ns.node_rank < -1:
        raise InputError("--node_rank", f"must be in 0..{len(hosts) - 1} (node ranks: {names}), got {ns.node_rank}")
    if ns.node_rank >= 0:
        return []
    matches = [k for k, h in enumerate(hosts) if is_this_host(h)]
    if len(matches) != 1:
        raise InputError("--node_rank", f"this machine ({socket.gethostname()!r}) is not one of the plan's hosts: "
                                        f"give --node_rank K (node ranks: {names})")
    return ["--node_rank", str(matches[0])]


def is_this_host(host: str) -> bool:
    """Is ``host`` (a cluster file's host field) this machine: its host name (or the name's first label), or an
    IP address of one of its interfaces (binding to it succeeds only then)? No DNS lookup: it may hang."""
    name = socket.gethostname()
    if host in (name, name.split(".")[0], "localhost"):
        return True
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        socket.inet_pton(family, host)
    except OSError:
        return False  # a name, not an address
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OWN_FLAGS = ("--hetero-plan", "--local", "--dry-run", "--resume", "--verbose", "--elastic")  # hethub launch's; the rest is DeepSpeed's


def _own_flags_first(argv: list[str]) -> list[str]:
    """hethub launch's own flags moved before the others, wherever they stand before the script (the first
    ``.py`` token): ``--elastic --min-nodes 1 --hetero-plan P train.py`` is ``--hetero-plan P --elastic ...``."""
    end = next((k for k, tok in enumerate(argv) if tok.endswith(".py")), len(argv))
    own, other, i = [], [], 0
    while i < end:
        tok = argv[i]
        if tok in ("--hetero-plan", "--hetero_plan", "--resume"):
            own += argv[i:i + 2]
            i += 2
        elif tok.split("=")[0] in ("--hetero-plan", "--hetero_plan") or tok in OWN_FLAGS or tok in ("-h", "--help"):
            own.append(tok)
            i += 1
        else:
            other.append(tok)
            i += 1
    return own + other + argv[max(end, i):]


def parse_launch_args(argv: Sequence[str]) -> tuple[str, bool, bool, list[str], bool]:
    """hethub's own flags (--hetero-plan P, --local, --dry-run, --resume DIR, --verbose, --elastic), in any order
    before the script; the rest goes to DeepSpeed's launcher (to torch's elastic agent with --elastic:
    ``elastic_launch``)."""
    plan, local, dry, resume, verbose, elastic, i = None, False, False, None, False, False, 0
    argv = _own_flags_first(list(argv))
    while i < len(argv):
        tok = argv[i]
        if tok in ("--hetero-plan", "--hetero_plan"):
            if i + 1 >= len(argv):
                raise InputError("--hetero-plan", "expects a plan file")
            plan, i = argv[i + 1], i + 2
        elif tok.startswith("--hetero-plan=") or tok.startswith("--hetero_plan="):
            plan, i = tok.split("=", 1)[1], i + 1
        elif tok == "--local":
            local, i = True, i + 1
        elif tok == "--resume":
            if i + 1 >= len(argv):
                raise InputError("--resume", "expects the checkpoint directory")
            resume, i = argv[i + 1], i + 2
        elif tok == "--dry-run":
            dry, i = True, i + 1
        elif tok == "--verbose":
            verbose, i = True, i + 1
        elif tok == "--elastic":
            elastic, i = True, i + 1
        elif tok in ("-h", "--help"):
            raise SystemExit(_usage())
        else:
            break
    if plan is None:
        raise InputError("--hetero-plan", "is required: hethub launch --hetero-plan plan.json [--local] "
                                          "[deepspeed flags] train.py [args]")
    rest = argv[i:]
    if elastic:
        if local or resume is not None:
            raise InputError("--elastic", "resumes from --checkpoint-dir by itself, on every host: without --local "
                                          "or --resume")
        return plan, False, dry, rest, True
    if not verbose:
        rest = _quiet(rest)
    if resume is not None:
        rest = _insert_after_script(rest, ["--hetero-resume", resume])
    return plan, local, dry, rest, False


_LOG_FLAGS = ("--log_level", "-q", "--quiet")  # DeepSpeed's runner's: the user's choice wins
_OWN_FLAGS = ("--log_level", "--master_port")  # DeepSpeed's runner's flags hethub adds (``--name=value``)


def _quiet(rest: list[str]) -> list[str]:
    """DeepSpeed's runner and per-node launcher log at INFO by default (34 of 39 lines of a local run): warnings
    and above unless the user chose a level or asked for ``--verbose``."""
    if not rest:
        return rest
    flags, _script, _args = split_script(rest)
    if any(f.split("=")[0] in _LOG_FLAGS for f in flags):
        return rest
    return ["--log_level=warning", *rest]


def _insert_after_script(rest: list[str], extra: list[str]) -> list[str]:
    flags, script, script_args = split_script(rest)
    return [*flags, script, *extra, *script_args]


def _usage() -> str:
    print("usage: hethub launch --hetero-plan plan.json [--local] [--resume DIR] [--dry-run] [--verbose] "
          "[deepspeed launcher flags] "
          "train.py [script args]\n"
          "       hethub launch --elastic --hetero-plan plan.json --master_addr ADDR --master_port PORT "
          "--checkpoint-dir DIR --checkpoint-every N [--min-nodes K] [--max-restarts R] [--host NAME] "
          "train.py [script args]\n\n" + __doc__)
    return 0


DRY_RUN_HOSTFILE = "HOSTFILE"  # the dry run's stand-in for the temporary hostfile's path


def run(plan_path: str, rest: Sequence[str], local: bool = False, dry_run: bool = False, elastic: bool = False) -> int:
    if elastic:
        el = elastic_launch.parse(plan_path, rest, is_this_host)
        _check_script(el.script)
        return elastic_launch.run(el, dry_run)
    plan = load_plan(plan_path)
    layout = host_layout(plan)
    if not rest:
        raise InputError("launch", "no training script given: hethub launch --hetero-plan plan.json train.py")
    if dry_run:
        cmd, _ = build_command(os.path.abspath(plan_path), plan, rest, local, DRY_RUN_HOSTFILE, dry_run=True)
        _check_script(rest)
        _check_config(plan, rest)
        print(" ".join(cmd))
        if not local:
            print(f"# {DRY_RUN_HOSTFILE} (the launch writes it to a temporary folder; a dry run writes nothing):\n"
                  + hostfile_text(plan), end="")
        return 0
    if importlib.util.find_spec("deepspeed") is None:  # a dry run needs none (it prints the command)
        raise missing_package("launch", "deepspeed")
    folder = tempfile.mkdtemp(prefix="hethub-")
    try:
        cmd, env = build_command(os.path.abspath(plan_path), plan, rest, local, os.path.join(folder, "hostfile"))
        _check_script(rest)
        _check_config(plan, rest)
        hosts = len(layout) if not local else 1
        print(f"hethub: starting {count(plan.world_size, 'rank')} on {count(hosts, 'host')} under DeepSpeed's launcher "
              "(each rank imports torch and DeepSpeed first: often 10-30 s before its first line)", flush=True)
        return _run_launcher(cmd, env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # our own temporary folder: only the hostfile is in it


CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config")  # the script's ds_config, as DeepSpeed names it


def _check_config(plan: Plan, rest: Sequence[str]) -> None:
    """The ds_config the script is given, checked against the plan here: one line in a second, not one per rank
    after ~25 s of start-up inside DeepSpeed's logs."""
    _flags, _script, args = split_script(rest)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in CONFIG_FLAGS:
            path = value if eq else (args[i + 1] if i + 1 < len(args) else None)
            if path is None:
                raise InputError(name, "expects the ds_config file")
            check_config(plan, load_config(path))


def _check_script(rest: Sequence[str]) -> None:
    """The training script exists here (each rank would otherwise print its own "can't open file"), unless the
    launcher is told to run a module or a program."""
    flags, script, _args = split_script(rest)
    if any(f.split("=")[0] in ("--module", "-m", "--no_python", "--no-python") for f in flags):
        return
    if not os.path.isfile(script):
        raise InputError("launch", f"no training script {script[:200]!r} (from {os.getcwd()[:200]!r}); every rank "
                                   "would fail to start it")


def _run_launcher(cmd: list[str], env: dict) -> int:
    """DeepSpeed's runner in a session of its own: Ctrl-C ends it and every rank it started."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        return 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
