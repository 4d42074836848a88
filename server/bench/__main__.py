"""`python -m epd.server.bench ...`: the same as `epd bench ...`."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":  # a spawned rank process imports this module too: only run once
    sys.exit(main())
