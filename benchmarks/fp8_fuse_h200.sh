#!/usr/bin/env bash
# One device call (<= 360 s) for issue 19's fused fp8 activation quantization (the norms and silu_and_mul
# emitting e4m3 codes + row scales for the fp8 linear after them: kernels/fp8_activation.py) on an H200:
#   1. GPU tests (tests/kernels/test_fp8_activation.py, bf16 added): the fused kernels against the unfused
#      kernels (bit for bit) and the references, and the fp8 linears they feed (a failure does not stop the rest);
#   2. benchmarks/fp8_fuse_gpu.py: per kernel, fused against producer + quantize_rows_fp8_triton at 1-4,096 rows
#      -> $OUT/fp8_fuse_kernels_h200.json;
#   3. benchmarks/engine_gpu.py, bf16 and fp8 linears in one run: decode b1/b8/b64 ctx512, b1 ctx4096, prefill
#      4096 (rows `<workload>` and `<workload>_fp8_w`) -> $OUT/engine_gpu_fp8fuse_h200.json;
#   4. the fp8 rows again with the fusion off (engine/model.py FUSE_FP8_ACTIVATIONS, `--quantization
#      fp8-unfused`: rows `<workload>_fp8_w_unfused`), the A/B -> $OUT/engine_gpu_fp8unfused_h200.json.
# LIMIT (default 350) is the whole script's time budget in s; the engine runs get what the earlier steps leave.
# Carry .whl (bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi).    OUT=dir bash benchmarks/fp8_fuse_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
limit=${LIMIT:-350}

step "GPU tests"
timeout 75 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_fp8_activation.py \
  >"$OUT/fp8_fuse_tests_h200.log" 2>&1
echo "tests rc $?"; tail -n 8 "$OUT/fp8_fuse_tests_h200.log"

step "kernels: fused vs unfused"
(cd benchmarks && timeout 45 python3 fp8_fuse_gpu.py --out "$OUT/fp8_fuse_kernels_h200.json") \
  >"$OUT/fp8_fuse_kernels_h200.log" 2>&1
echo "kernels rc $?"; tail -n 8 "$OUT/fp8_fuse_kernels_h200.log"

step "engine rows: bf16 and fp8 (fused)"
left=$((limit - (SECONDS - t0) - 20))
(cd benchmarks && timeout $((left * 2 / 3)) python3 engine_gpu.py --skip-hf --skip-transfer --quantization none,fp8 \
  --repeat 10 --out "$OUT/engine_gpu_fp8fuse_h200.json") >"$OUT/engine_gpu_fp8fuse_h200.log" 2>&1
echo "engine rc $?"; tail -n 16 "$OUT/engine_gpu_fp8fuse_h200.log"

step "engine rows: fp8 unfused (A/B)"
left=$((limit - (SECONDS - t0)))
(cd benchmarks && timeout $left python3 engine_gpu.py --skip-hf --skip-transfer --quantization fp8-unfused \
  --repeat 10 --out "$OUT/engine_gpu_fp8unfused_h200.json") >"$OUT/engine_gpu_fp8unfused_h200.log" 2>&1
echo "engine unfused rc $?"; tail -n 9 "$OUT/engine_gpu_fp8unfused_h200.log"
step "done"
