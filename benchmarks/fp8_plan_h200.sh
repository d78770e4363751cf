#!/usr/bin/env bash
# One device call for the fp8 cache's launch plan (kernels/decode_attention_triton.py fp8_plan: from one program
# a SM on, 64-key two-warp tiles split to ~6 programs a SM), <= 420 s after the wheels:
#   1. the GPU tests of fp8 and decode attention, the fp8 engine and the CUDA graphs, while 10 processes compile;
#   2. benchmarks/decode_attention_fp8_gpu.py: the plan's row and both tiles at 1/2/4/8 splits, batches 16-256
#      -> $OUT/decode_attention_fp8_plan.json;
#   3. benchmarks/engine_gpu.py's fp8 KV rows (b64 ctx 4,096): the plan against one 128x4x1 tile at every batch
#      (the default before it), in the same run -> $OUT/engine_gpu_fp8_plan.json; with QUANTIZATION=none,fp8 also
#      the decode b1/b8/b64 ctx 512, b1 ctx 4,096 and prefill 4,096 rows with bf16 and fp8 linears (issue 19's
#      and 23's other targets).
# TILES, SPLITS, SHAPES (empty: no sweep and no compile step), ENGINE_VARIANTS (engine_gpu.py --fp8-kv-variants;
# empty: none) and FP8_KV_ROUNDS (--fp8-kv-rounds) narrow or widen it.
# Carry .whl.   OUT=dir bash benchmarks/fp8_plan_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
SWEEP=(--variants kt --tiles "${TILES:-128x4x1,64x2x1}" --splits "${SPLITS:-auto,2,4,8}")
SHAPES=${SHAPES-b16_ctx4096,b32_ctx4096,b64_ctx4096,b128_ctx4096,b64_ctx512,b256_ctx512,b1_ctx4096}
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"

step "GPU tests + compile (10 processes)"
TESTS=${TESTS-tests/kernels/test_fp8_kv.py tests/engine/test_fp8_kv_cuda.py tests/kernels/test_decode_attention.py \
  tests/engine/test_cuda_graphs.py}  # TESTS= (empty) skips them
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" ${TESTS:---version} \
  >"$OUT/fp8_plan_tests.log" 2>&1 &
tests=$!
warms=()
for i in $(seq 0 9); do
  [ -n "$SHAPES" ] || break
  (cd benchmarks && timeout 100 python3 decode_attention_fp8_gpu.py "${SWEEP[@]}" --warm "$i/10") >"$OUT/warm_$i.log" 2>&1 &
  warms+=($!)
done
for pid in "${warms[@]}"; do wait "$pid"; done
cat "$OUT"/warm_*.log 2>/dev/null | grep -v '^$' | head -n 10; rm -f "$OUT"/warm_*.log
wait "$tests"; echo "tests rc $?"; tail -n 2 "$OUT/fp8_plan_tests.log"
grep -h -E "^(FAILED|ERROR)" "$OUT/fp8_plan_tests.log" | head -n 10

if [ -n "$SHAPES" ]; then
  step "sweep"
  (cd benchmarks && timeout 150 python3 decode_attention_fp8_gpu.py "${SWEEP[@]}" --plan --shapes "$SHAPES" \
    --budget-s 130 --out "$OUT/decode_attention_fp8_plan.json") >"$OUT/decode_attention_fp8_plan.log" 2>&1
  echo "sweep rc $?"; grep -E "^==|plan:|splits " "$OUT/decode_attention_fp8_plan.log" | tail -n 45
fi

step "engine rows"
left=$((560 - (SECONDS - t0)))
(cd benchmarks && timeout "$left" python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 --quantization "${QUANTIZATION:-}" \
  --fp8-kv --fp8-kv-variants "${ENGINE_VARIANTS-kt@128x4x1,kt@128x4x1/64x2x1:6}" \
  --fp8-kv-rounds "${FP8_KV_ROUNDS:-1}" --out "$OUT/engine_gpu_fp8_plan.json") \
  >"$OUT/engine_gpu_fp8_plan.log" 2>&1
echo "engine rc $?"; grep -E "^(decode_b|prefill_4096)|fp8 KV" "$OUT/engine_gpu_fp8_plan.log" | tail -n 40
step "done"
