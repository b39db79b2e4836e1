"""The ``hethub`` command: one module per command (``plan``/``simulate``/``explain`` live in ``main``, beside the
parser), each importing only what its command needs, so ``hethub plan`` never imports torch.

``main`` here is the console script's entry. Ctrl-C is one line and exit 130 at any moment, the command's imports
included: the handler (``interrupts``) is installed before them."""
import os
import signal
import sys
import threading

from . import clock
from .interrupts import INTERRUPTED, interrupted, on_interrupt, quiet_unraisable, reset, say_interrupted

__all__ = ["main"]


def main(argv=None) -> int:
    clock.mark_start(shell=argv is None)
    reset()
    on_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, on_interrupt) if on_main_thread else None
    unraisable_before = sys.unraisablehook
    sys.unraisablehook = quiet_unraisable(unraisable_before)
    try:
        from .main import main as run  # lazy: an interrupt during these imports is caught below
        code = run(argv)
    except KeyboardInterrupt:
        code = say_interrupted()
    except BaseException as exc:  # noqa: BLE001 - re-raised unless it is an interrupt a library reworded
        # while importing: pydantic building a model's validator (SchemaError wrapping the KeyboardInterrupt), or
        # pydantic-core's Rust code panicking (PanicException, a BaseException) when the interrupt cut the import of
        # a module it needs
        if isinstance(exc, SystemExit) or not interrupted():
            raise
        code = say_interrupted()
    finally:
        clock.clear()
        sys.unraisablehook = unraisable_before
        if on_main_thread:
            signal.signal(signal.SIGINT, before)
    if interrupted():  # a library swallowed or reworded it: the user asked to stop all the same
        code = say_interrupted()
    if code == INTERRUPTED and argv is None:
        # From the shell: exit now. CPython remembers a KeyboardInterrupt that crossed some of its own frames during
        # start-up even when it was caught, and would end the process by SIGINT (exit -2) after the line was said.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    return code
