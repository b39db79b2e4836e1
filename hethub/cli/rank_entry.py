"""Each rank ``hethub launch`` starts: the plan in force, DeepSpeed routed through hethub, then the user's script.

    python -m hethub.cli.rank_entry --hetero-plan PLAN [--module] SCRIPT [script args]

Why an entry point: the script is the user's, unchanged; it may never mention hethub and its argument parser
need not know ``--hetero-plan``. The plan reaches the rank here (an argument of this module, so that every
launcher, pdsh included, carries it), is exported as ``HETHUB_PLAN`` (``hethub.add_config_arguments`` and
``hethub.initialize`` read it), and ``hethub.runtime.routing`` makes ``deepspeed.initialize`` build hethub's
engine. The script then runs as ``python SCRIPT`` (or ``python -m``) would run it; a script that ends without
building an engine under the plan is one line and exit 2.
"""
from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    # DeepSpeed's per-node launcher puts --local_rank=N first (unless --no_local_rank): it is the script's, and
    # goes back where the script expects it, before its own arguments
    ds_args = [a for a in argv[:1] if a.startswith("--local_rank")]
    argv = argv[len(ds_args):]
    if len(argv) < 3 or argv[0] != "--hetero-plan":
        print("usage: python -m hethub.cli.rank_entry --hetero-plan PLAN [--module] SCRIPT [args]", file=sys.stderr)
        raise SystemExit(2)
    os.environ["HETHUB_PLAN"] = argv[1]
    module = argv[2] == "--module"
    target, args = (argv[3], argv[4:]) if module else (argv[2], argv[3:])
    from ..runtime import routing  # lazy: the routing imports torch and DeepSpeed, a rank's first work
    routing.install()
    sys.argv = [target, *ds_args, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code in (None, 0):
            routing.check_ended_under_plan()
        raise
    routing.check_ended_under_plan()


if __name__ == "__main__":
    main(sys.argv[1:])
