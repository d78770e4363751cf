#!/usr/bin/env bash
# One device call for issue 19's fp8 linears: the GPU kernel tests, the per-shape timing of fp8 vs bf16
# (benchmarks/linear_fp8_gpu.py), then engine_gpu.py's decode/prefill rows for bf16 and fp8 linears in one run.
#   OUT=/some/dir bash benchmarks/fp8w_h200.sh        (run from the repository root on the H200, after pip -e .)
set -uo pipefail
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.csv" 2>&1
timeout 85 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_linear_fp8.py \
  "tests/kernels/test_linear.py::test_linear_dispatcher_matches_ref" 2>&1 | tee "$OUT/fp8w_tests_h200.log" | tail -n 25
echo "tests: $((SECONDS - t0)) s"
timeout 60 python3 benchmarks/linear_fp8_gpu.py --out "$OUT/linear_fp8_h200.json" 2>&1 | tee "$OUT/linear_fp8_h200.log"
echo "linear: $((SECONDS - t0)) s"
timeout $((228 - (SECONDS - t0))) python3 benchmarks/engine_gpu.py --skip-hf --skip-transfer --repeat 10 \
  --out "$OUT/engine_gpu_fp8w_h200.json" 2>&1 | tee "$OUT/engine_gpu_fp8w_h200.log"
echo "total: $((SECONDS - t0)) s"
