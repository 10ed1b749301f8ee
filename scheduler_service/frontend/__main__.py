"""python -m scheduler_service.frontend --engine-core ADDR --listen HOST:PORT ... (see frontend_process)."""

import sys

from scheduler_service.frontend.frontend_process import run

if __name__ == "__main__":
    sys.exit(run())
