#!/usr/bin/env bash
# Sets up what is missing, then runs ruff, the type checker (mypy, configured in pyproject.toml) and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
