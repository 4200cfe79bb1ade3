"""``python -m verlite``: the same as the ``verlite`` command."""

import sys

from verlite.cli import main

sys.exit(main())
