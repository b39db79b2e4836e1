"""``python -m hethub.cli ...``: the same as the ``hethub`` command (launchers such as torchrun take ``-m``)."""
import sys

from . import main  # the package's entry: an interrupt while the command's modules import is one line too

sys.exit(main())
