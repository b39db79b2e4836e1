"""The ``hethub`` command: one module per command (``plan``/``simulate``/``explain`` live in ``main``, beside the
parser), each importing only what its command needs, so ``hethub plan`` never imports torch.

``main`` here is the console script's entry: Ctrl-C while the command's modules are still being imported (a
second or two before any work) is one line too, as it is everywhere after (``main.main``)."""
import sys

__all__ = ["main"]


def main(argv=None) -> int:
    try:
        from .main import main as run  # lazy: an interrupt during these imports is caught below
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return run(argv)
