#!/usr/bin/env bash
# Creates .venv and installs pagedserve with its dev extra. torch 2.13.0 (CPU) goes in first so
# pip never pulls a CUDA build. Re-running is cheap: it skips when pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.pagedserve-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
# The C++ CPU kernels (g++, ninja): paged attention and packed-weight linear layers, built once per machine
# and source, cached under ~/.cache/pagedserve/kernels; the executor falls back to torch where they cannot be built.
.venv/bin/python -m executor_service.kernels || true
