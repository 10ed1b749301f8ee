#!/usr/bin/env bash
# Regenerates the Python modules beside the .proto files. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/pagedserve/v1/*.proto
