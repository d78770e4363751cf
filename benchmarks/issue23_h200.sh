#!/usr/bin/env bash
# One device call for issue 23 (prefill at the engine's speed): the GPU tests, then the compile count after the
# warm-up, then SDPA vs our prefill attention (and the whole 4,096-token prefill); logs and JSON land in $OUT.
#   OUT=/some/dir bash benchmarks/issue23_h200.sh [tests] [compiles] [sdpa]     (default: all three, in order)
# The test files run in parallel processes first (they share Triton's on-disk cache, compiles dominate); the
# benchmarks then run alone on the GPU, each cut off at what is left of ~570 s.
set -uo pipefail
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1
t0=$SECONDS
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests compiles sdpa)
left() { echo $((570 - (SECONDS - t0))); }
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.csv"
for part in "${parts[@]}"; do
  case $part in
    tests)
      logs=/tmp/issue23_tests && mkdir -p $logs
      # -o addopts="": the device has no pytest-rerunfailures, which pyproject's --reruns needs
      for f in tests/engine/test_prefill_warm_up.py tests/kernels/test_prefill_attention.py \
               tests/kernels/test_specialization.py tests/kernels/test_rope.py tests/kernels/test_rms_norm.py \
               tests/kernels/test_linear.py tests/kernels/test_decode_attention.py tests/kernels/test_block_copy.py \
               tests/kv_transfer/test_cuda_ipc.py tests/kv_transfer/test_tcp_cuda.py tests/engine/test_cuda_graphs.py \
               tests/engine/test_model_forward.py; do
        name=$(basename "$f" .py)
        (timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" --durations=5 -rs "$f" \
           >"$logs/$name.log" 2>&1; echo "exit $?" >>"$logs/$name.log") &
      done
      wait
      for f in $logs/test_*.log; do echo "== $(basename "$f")"; cat "$f"; done >"$OUT/issue23_tests.log"
      grep -H -E "passed|failed|error|^exit" $logs/test_*.log
      echo "tests: $((SECONDS - t0)) s" ;;
    compiles)
      timeout "$(left)" python3 benchmarks/prefill_compiles.py --budget 2048 2>&1 | tee "$OUT/prefill_compiles.log"
      timeout "$(left)" python3 benchmarks/prefill_compiles.py --budget 8192 --batches 100 2>&1 \
        | tee -a "$OUT/prefill_compiles.log"
      echo "compiles: $((SECONDS - t0)) s" ;;
    sdpa)
      timeout "$(left)" python3 benchmarks/prefill_attention_sdpa.py --engine 2>&1 | tee "$OUT/prefill_attention_sdpa.log"
      echo "sdpa: $((SECONDS - t0)) s" ;;
    *) echo "unknown part $part (tests, compiles, sdpa)"; exit 2 ;;
  esac
done
echo "total: $((SECONDS - t0)) s"
