"""Ctrl-C on the command line: remembered, said once, exit 130 (``hethub.cli.main``).

Why remembered: a library may swallow the KeyboardInterrupt (PuLP imports HiGHS under a bare ``except:`` and then
finds it "not available") or reword it (HiGHS running a Python callback); the command still ends as interrupted."""
import sys

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C
_STATE = {"seen": False, "said": False}


def reset() -> None:
    _STATE.update(seen=False, said=False)


def on_interrupt(signum, frame):
    """Ctrl-C: remembered (``interrupted``), then raised as Python does."""
    _STATE["seen"] = True
    raise KeyboardInterrupt


def quiet_unraisable(previous):
    """A ``sys.unraisablehook`` that says nothing of a Ctrl-C raised where Python cannot raise it.

    Why: the handler raises KeyboardInterrupt in whatever Python runs when the signal lands; inside a weakref
    callback (importlib's module-lock clean-up during an import) Python only prints it as "Exception ignored in:"
    with a traceback, and the command goes on until it meets the remembered interrupt and says its one line.
    Anything else unraisable still goes to ``previous``."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _STATE["seen"]:
            return
        previous(unraisable)
    return hook


def interrupted() -> bool:
    return _STATE["seen"]


def say_interrupted() -> int:
    """The one line (once) and the exit code."""
    if not _STATE["said"]:
        _STATE["said"] = True
        print("error: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED
