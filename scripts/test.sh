#!/usr/bin/env bash
# Sets up what is missing, then runs ruff, the type checker (mypy, configured in pyproject.toml) and the whole test suite
# on PAGEDSERVE_TEST_WORKERS pytest-xdist workers (default 2), each taking whole files (a file's module fixtures
# start their servers once). One pytest process keeps 1.15 of the 2 cores busy; two keep 1.8 busy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -n "${PAGEDSERVE_TEST_WORKERS:-2}" --dist loadfile "$@"
