#!/usr/bin/env bash
# One device call for issue 19's decode-batch fp8 linear (kernels/linear_fp8_skinny_triton.py) on an H200:
#   1. its GPU tests (bf16 and the llama3-8b shapes);
#   2. benchmarks/linear_fp8_skinny_gpu.py: the config sweep at llama3-8b's shapes, written into
#      kernels/linear_fp8_configs.json (copied to $OUT: commit it);
#   3. benchmarks/engine_gpu.py: decode and prefill rows for bf16 and fp8 linears in one run, with that table.
# Carry .whl (bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi).    OUT=dir bash benchmarks/fp8_skinny_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }

step "GPU tests"
timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/kernels/test_linear_fp8.py \
  >"$OUT/fp8_skinny_tests_h200.log" 2>&1
tail -n 6 "$OUT/fp8_skinny_tests_h200.log"

step "sweep"
(cd benchmarks && timeout 250 python3 linear_fp8_skinny_gpu.py --out "$OUT/linear_fp8_skinny_h200.json" \
  --table ../kernels/linear_fp8_configs.json) >"$OUT/linear_fp8_skinny_h200.log" 2>&1
tail -n 22 "$OUT/linear_fp8_skinny_h200.log"
cp kernels/linear_fp8_configs.json "$OUT/" 2>/dev/null

step "engine rows"
left=$((560 - (SECONDS - t0)))
(cd benchmarks && timeout $left python3 engine_gpu.py --skip-hf --skip-transfer --quantization none,fp8 --repeat 10 \
  --out "$OUT/engine_gpu_fp8w_h200.json") >"$OUT/engine_gpu_fp8w_h200.log" 2>&1
tail -n 22 "$OUT/engine_gpu_fp8w_h200.log"
step "done"
