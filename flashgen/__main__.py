"""``python -m flashgen``: same as the ``flashgen`` script (see :mod:`flashgen.cli.commands`)."""

import sys

from flashgen.cli.commands import main

sys.exit(main())
