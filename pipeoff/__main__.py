"""``python -m pipeoff``: the ``pipeoff`` command (``pipeoff --help``)."""

from __future__ import annotations

import sys

from pipeoff.cli import main

if __name__ == "__main__":
    sys.exit(main())
