"""``hethub`` command line.

Every command: ``--help``; exit 0 on success; exit 2 with one line naming the bad field or flag on bad input,
never a traceback for a user error. Each command lives in its own module (``plan``, ``simulate``, ``show``,
``export``, ``profiler``, ``launch``, ``demo``), imported only when it runs: the planning commands import no torch.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from ..partitioner.errors import EXTRA_OF, InputError, missing_package, print_error
from .interrupts import interrupted, on_interrupt, say_interrupted
from .parser import build_parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    before = signal.signal(signal.SIGINT, on_interrupt)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGINT, before)


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["launch"]:  # DeepSpeed's flags pass through unparsed: see hethub.cli.launch
            launch = importlib.import_module(".launch", __package__)  # lazy: DeepSpeed's runner, only here
            plan, local, dry, rest, elastic = launch.parse_launch_args(argv[1:])
            return launch.run(plan, rest, local=local, dry_run=dry, elastic=elastic)
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return 0
        module, _, func = args.run.partition(":")
        if module == "demo":  # the demo runs on CPU by design: DeepSpeed need not warn that it found no GPU
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # lazy: only the command that runs is imported (profiler and demo import torch, plan must not)
        return int(getattr(importlib.import_module(f".{module}", __package__), func)(args) or 0)
    except InputError as exc:
        print_error(str(exc))
        return 2
    except ModuleNotFoundError as exc:  # a planning-only install running profile or demo: name the extra
        if (exc.name or "").split(".")[0] not in EXTRA_OF:
            raise
        print_error(str(missing_package(argv[0] if argv else "hethub", exc.name)))
        return 2
    except KeyboardInterrupt:
        return say_interrupted()
    except Exception:  # noqa: BLE001 - re-raised unless it is an interrupt a library reworded (hethub.cli)
        if not interrupted():
            raise
        return say_interrupted()

