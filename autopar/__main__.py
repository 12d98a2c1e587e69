"""``python -m autopar``: the same as the ``autopar`` command (see autopar/cli.py)."""

import sys

from autopar.cli import main

sys.exit(main())
