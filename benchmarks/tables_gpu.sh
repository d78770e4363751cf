#!/usr/bin/env bash
# One device call that measures this card's kernel tables and times issue 19's rows with them, before and after:
#   1. benchmarks/engine_gpu.py's decode and prefill rows, bf16 and fp8 linears, with the tables as committed;
#   2. benchmarks/linear_fp8_skinny_gpu.py: the fp8 skinny linear's config sweep -> kernels/linear_fp8_configs.json;
#   3. benchmarks/kernels.py --only gemv --tune-linear: the bf16 GEMV's -> kernels/linear_configs.json;
#   4. the GPU tests of both linears, the CUDA graphs and the fp8 KV kernels, with the new tables (on an H100,
#      2026-12-06: 336 passed);
#   5. the rows again in issue 19's four settings (bf16, fp8 linears, fp8 KV, both: engine_gpu.py's -fp8kv), and
#      the fp8 KV rows (b64 ctx 4,096, both caches with both linears, three runner builds, synchronised and back
#      to back).
# The tables and JSON come back in $OUT, the logs packed into logs_<card>.tgz (a call returns at most 8 files;
# commit them with the JSON). The whole took 310 s on an H100 (2026-12-06) before step 5 had the fp8 KV settings
# (~50 s more); on the H200 (2026-12-06, the tables shipped since) 279 s, 344 tests passed
# (results/engine_gpu_tables_{before,after}_h200.json, docs/quantization.md).
# Carry .whl (bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi).    OUT=dir [TABLES_LIMIT_S=560] bash benchmarks/tables_gpu.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")

step "engine rows before ($card)"
(cd benchmarks && timeout 100 python3 engine_gpu.py --skip-hf --skip-transfer --quantization none,fp8 --repeat 10 \
  --out "$OUT/engine_gpu_tables_before_$card.json") >"$OUT/engine_gpu_tables_before_$card.log" 2>&1
grep -E "^(decode_b|prefill)" "$OUT/engine_gpu_tables_before_$card.log"

step "fp8 skinny sweep"
(cd benchmarks && timeout 150 python3 linear_fp8_skinny_gpu.py --out "$OUT/linear_fp8_skinny_$card.json" \
  --table ../kernels/linear_fp8_configs.json) >"$OUT/linear_fp8_skinny_$card.log" 2>&1
grep -v -i warn "$OUT/linear_fp8_skinny_$card.log" | tail -n 20
cp kernels/linear_fp8_configs.json "$OUT/"

step "bf16 GEMV tune"
timeout 150 python3 benchmarks/kernels.py --only gemv --tune-linear kernels/linear_configs.json \
  --json "$OUT/kernels_gemv_$card.json" >"$OUT/kernels_gemv_tune_$card.log" 2>&1
grep "gemv tune" "$OUT/kernels_gemv_tune_$card.log" | cut -c1-110
cp kernels/linear_configs.json "$OUT/"

step "GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" tests/kernels/test_linear.py \
  tests/kernels/test_linear_fp8.py tests/engine/test_cuda_graphs.py tests/kernels/test_fp8_kv.py \
  tests/engine/test_fp8_kv_cuda.py >"$OUT/tables_tests_$card.log" 2>&1
echo "tests rc $?"; tail -n 2 "$OUT/tables_tests_$card.log"; grep -E "^(FAILED|ERROR)" "$OUT/tables_tests_$card.log" | head

step "engine rows after"
left=$((${TABLES_LIMIT_S:-560} - (SECONDS - t0)))  # TABLES_LIMIT_S: the whole script's seconds
(cd benchmarks && timeout "$left" python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 \
  --quantization none,fp8,none-fp8kv,fp8-fp8kv \
  --fp8-kv --fp8-kv-rounds 3 --out "$OUT/engine_gpu_tables_after_$card.json") >"$OUT/engine_gpu_tables_after_$card.log" 2>&1
grep -E "^(decode_b|prefill)|round" "$OUT/engine_gpu_tables_after_$card.log"
(cd "$OUT" && tar -czf "logs_$card.tgz" ./*.log gpu.csv && rm -f ./*.log gpu.csv)
step "done"
