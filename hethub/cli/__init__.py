"""The ``hethub`` command: one module per command (``plan``/``simulate``/``explain`` live in ``main``, beside the
parser), each importing only what its command needs, so ``hethub plan`` never imports torch."""
from .main import main

__all__ = ["main"]
