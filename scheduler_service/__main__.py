"""python -m scheduler_service --listen HOST:PORT --executor HOST:PORT ... (see scheduler_service.launch)."""

import sys

from scheduler_service.launch import run

if __name__ == "__main__":
    sys.exit(run())
