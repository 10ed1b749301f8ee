#!/usr/bin/env bash
# The CUDA path for real, as one script for a machine with an NVIDIA GPU (e.g. the device tool's H200):
# Triton kernels compiled for real against the reference, greedy equality with transformers through the
# whole gRPC stack with the executor on CUDA (swap to pinned CPU memory included), the executor conformance
# suite on CUDA, the device's limits and kernels (benchmarks/gpu_bench.py: matmul peak, HBM bandwidth, Triton
# vs SDPA, pinned swap GB/s, CUDA-graph decode vs eager), decode throughput, served throughput against
# transformers eager and with CUDA graphs (their step logs: a step of ~1 s is a Triton compile mid-serving), and
# with two or more GPUs tensor parallelism (TP=2) over NCCL. Writes one log per step (8 files; 10 with two GPUs)
# under $OUT (default /tmp/gpu_check). The whole script stops after LIMIT seconds (default 540): each step gets
# what is left; the first H200 run needed 242 s of 430 for what it ran then.
#
#   bash benchmarks/gpu_check.sh            # LIMIT=900 bash benchmarks/gpu_check.sh for a longer budget
#
# A machine without internet whose Python lacks some of this project's packages takes wheels from .whl/ (the
# device tool's folder) or .gpu-wheels/, made beforehand where PyPI is reachable, for that machine's Python, e.g.
#  pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl grpcio==1.85.3 protobuf==7.36.2 \
#      grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 msgspec pyzmq 'pytest-asyncio>=1.0'
# They are installed into a folder put first on PYTHONPATH (the servers the tests start inherit it), so the
# machine's own torch, Triton and transformers stay in use.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
for wheels in .whl .gpu-wheels; do
  if [ -d "$wheels" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pagedserve-site \
      "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/pagedserve-site${PYTHONPATH:+:$PYTHONPATH}
  fi
done
# the model and kernel caches stay outside $OUT, which holds only the step logs
export PAGEDSERVE_TEST_DEVICE=cuda TRITON_INTERPRET=0 PAGEDSERVE_CACHE_DIR=${PAGEDSERVE_CACHE_DIR:-/tmp/pagedserve-gpu-cache}
LIMIT=${LIMIT:-540}
deadline=$((SECONDS + LIMIT))
status=0
run() {
  local name=$1; shift
  local left=$((deadline - SECONDS))
  if [ "$left" -le 5 ]; then echo "== $name: skipped, time limit reached" | tee "$OUT/$name.txt"; status=1; return; fi
  echo "== $name (<= ${left}s): $*"
  timeout --signal=TERM --kill-after=10 "$left" "$@" 2>&1 | tee "$OUT/$name.txt"
  status=$((status | PIPESTATUS[0]))
}
nvidia-smi  # to the output only: $OUT holds the step logs (the device tool returns 8 files)
run attention "$PY" -m pytest -q -p no:cacheprovider --timeout 120 tests/executor/test_attention.py \
  tests/executor/test_forward_path.py::test_cuda_graph_decode_matches_eager tests/executor/test_kv_cache_swap.py \
  tests/executor/test_triton_specialization.py
run gpu_bench "$PY" -m benchmarks.gpu_bench  # one JSON line per part
run equality "$PY" -m pytest -q -p no:cacheprovider --timeout 120 tests/e2e/test_torch_grpc.py tests/e2e/test_conformance.py
run executor "$PY" -m benchmarks.executor --device cuda --batch-sizes 1,16,64,256 --steps 64
run vs_transformers "$PY" -m benchmarks.vs_transformers --device cuda --repeats 3 --step-log "$OUT/steps_eager.log"
run vs_transformers_graphs "$PY" -m benchmarks.vs_transformers --device cuda --repeats 3 --only pagedserve \
  --step-log "$OUT/steps_graphs.log" --executor-args "--cuda-graph-sizes 1,2,4,8,16,32,64,128"
# Tensor parallelism over NCCL needs two devices (NCCL refuses two ranks on one GPU); on one GPU, TP=2
# still runs over gloo on the CPU in the conformance suite above.
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${ngpu:-0}" -ge 2 ]; then
  run tp2_equality env PAGEDSERVE_TP_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/executor/test_tensor_parallel.py
  run tp2_decode "$PY" -m benchmarks.tensor_parallel --device cuda --batch-sizes 1,16,64,256 --steps 64
else
  echo "== tensor parallel on CUDA: skipped, ${ngpu:-0} GPU(s); it needs 2"
fi
exit $status
