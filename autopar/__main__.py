"""``python -m autopar``: the same as the ``autopar`` command (see autopar/explore/cli.py)."""

import sys

from autopar.explore.cli import main

sys.exit(main())
