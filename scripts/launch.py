"""Kept for old command lines: `python scripts/launch.py ARGS...` is `pagedserve serve ARGS...` (client/serve.py),
which scripts/up.sh runs."""

import sys

from client.serve import main

if __name__ == "__main__":
    sys.exit(main())
