#!/usr/bin/env bash
# Sets up what is missing, then runs the executor and the scheduler in the foreground (`pagedserve serve`,
# client/serve.py). Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pagedserve serve "$@"
