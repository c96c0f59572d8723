"""``python -m idemlock``: the same command line as the ``idemlock`` script."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
