"""``python -m hethub.cli ...``: the same as the ``hethub`` command (launchers such as torchrun take ``-m``)."""
import sys

from .main import main

sys.exit(main())
