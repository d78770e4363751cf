#!/usr/bin/env bash
# One device call for the kernels: the CUDA tests (bf16 included) and the benchmark; logs and JSON land in $OUT.
#   OUT=/some/dir bash benchmarks/kernels_h200.sh [sweep]    (sweep: config sweeps + GEMV tuning as well)
# Compilation dominates a cold run, so the test files and a compile-only pass of the benchmark run in parallel
# processes first (they share Triton's on-disk cache); the timed benchmark then runs alone on the GPU.
set -uo pipefail
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1
t0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv >"$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.csv"
logs=/tmp/kernels_run && mkdir -p $logs
for f in tests/kernels/test_*.py; do
  name=$(basename "$f" .py)
  (timeout 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" --confcutdir=tests/kernels --durations=5 "$f" \
     >"$logs/$name.log" 2>&1; echo "exit $?" >>"$logs/$name.log") &
done
extra=()
[ "${1:-}" = sweep ] && extra=(--sweep --tune-linear "$OUT/linear_configs.json")
for part in small decode prefill gemv; do
  timeout 420 python3 benchmarks/kernels.py --compile-only --only $part "${extra[@]}" >"$logs/warm_$part.log" 2>&1 &
done
wait
echo "tests + compile warm-up: $((SECONDS - t0)) s"
for f in $logs/test_*.log; do echo "== $(basename "$f")"; cat "$f"; done >"$OUT/kernels_tests_h200.log"
grep -H -E "passed|failed|error|^exit" $logs/test_*.log
tail -n 2 $logs/warm_*.log
timeout $((570 - (SECONDS - t0))) python3 benchmarks/kernels.py "${extra[@]}" --json "$OUT/kernels_h200.json" 2>&1 \
  | tee "$OUT/kernels_h200.log"
echo "total: $((SECONDS - t0)) s"
