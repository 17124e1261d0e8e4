"""``python -m flashgen``: same as the ``flashgen`` script (see :mod:`flashgen.cli`)."""

import sys

from .cli import main

sys.exit(main())
