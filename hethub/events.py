"""An elastic job's events, where users and tools look: one line on stderr each (said by whoever sees it), the same
as a JSON object per line in ``--log-json``'s file, and the request a worker leaves for every host's launcher to
end the job (``DIR/plans/.stop``).

Why a module of its own, without torch: the launcher (no torch imported) and the workers write the same records.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

EVENTS_ENV = "HETHUB_EVENTS"  # the --log-json file, handed by ``hethub launch --elastic`` to its workers
STOP_FILE = ".stop"
MAX_REASON_CHARS = 2000


_STEP_PLAN = re.compile(r"step-(\d{1,12})\.json")


def plan_files(checkpoint_dir: str) -> list[tuple[int, str]]:
    """(step it took over at, path) of every plan an elastic run recorded (``DIR/plans/step-<k>.json``), by step."""
    folder = os.path.join(checkpoint_dir, "plans")
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := _STEP_PLAN.fullmatch(name))]
    return [(step, os.path.join(folder, name)) for step, name in sorted(found)]


def stop_path(checkpoint_dir: str) -> str:
    """Where a worker asks every host's launcher to end the job (the checkpoint directory is shared by every host)."""
    return os.path.join(checkpoint_dir, "plans", STOP_FILE)


def log_event(path: str, kind: str, **fields) -> None:
    """Append ``{"event": kind, "t": unix time, **fields}`` as one line to ``path`` ("" or None: nowhere). One
    ``write`` of one line in append mode, so lines from several processes do not interleave."""
    if not path:
        return
    line = json.dumps({"event": kind, "t": round(time.time(), 3), **fields}, default=str) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:  # the events file is a report: training goes on, the line says it was not written
        sys.stderr.write(f"hethub: could not append to --log-json {path[:160]!r}: {exc.strerror or exc}\n")


def say(line: str, log_json: str = "", kind: str = "", **fields) -> None:
    """One line on stderr (``hethub elastic: ...``) and, when ``log_json`` is set, the same event as JSON."""
    sys.stderr.write(f"hethub elastic: {line}\n")
    sys.stderr.flush()
    if kind:
        log_event(log_json, kind, **fields, line=line)


def request_stop(checkpoint_dir: str, message: str) -> None:
    """A worker ended on input no restart can fix (exit 2): leave its line for every host's launcher to end the job
    (written whole, then renamed: a launcher never reads half of it)."""
    path = stop_path(checkpoint_dir)
    tmp = f"{path}.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(message[:MAX_REASON_CHARS] + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # the agent then restarts the job until --max-restarts: said, not hidden
        sys.stderr.write(f"hethub: could not ask the launchers to end the job ({path[:160]}: "
                         f"{exc.strerror or exc}); the agent restarts it up to --max-restarts times\n")


def read_stop(path: str) -> str:
    """The line a worker left in ``path`` (``request_stop``), for the launcher's last line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(MAX_REASON_CHARS).strip().splitlines()[0] if os.path.getsize(path) else "(no reason given)"
    except (OSError, IndexError):
        return "(its reason could not be read)"
