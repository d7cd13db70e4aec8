"""``python -m reshard demo``: the same as the ``reshard`` command."""

import sys

from .apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
