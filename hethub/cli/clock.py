"""When the command started: `plan --time-limit` is the command's limit, its own start-up (the interpreter, imports,
reading the inputs, the cost model) and its finish included, not only the search's."""
import os
import time
from typing import Optional

_STARTED: dict = {"s": None}


def mark_start(shell: bool) -> None:
    """Called first thing by the command's entry (``hethub.cli.main``), its imports not yet made. ``shell``: the
    process is this command's (the console script), so it started when the system says (Linux); else now."""
    _STARTED["s"] = time.perf_counter() - (_process_age_s() if shell else 0.0)


def _process_age_s() -> float:
    """Seconds since this process started (``/proc``; 0 elsewhere): the interpreter's own start-up, about 0.1 s."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def clear() -> None:
    _STARTED["s"] = None


def started_s() -> Optional[float]:
    """When this command started (``time.perf_counter()``); None where a command's function is called directly."""
    return _STARTED["s"]
