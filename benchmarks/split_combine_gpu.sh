#!/usr/bin/env bash
# One device call for split decode attention summed in one launch (kernels/decode_attention_triton.py COMBINE:
# each (sequence, kv head)'s last split program sums the partials) against the reduce kernel, <= 560 s after the
# wheels:
#   1. the GPU tests of decode attention, fp8, the fp8 engine and the CUDA graphs, while 10 processes compile;
#   2. benchmarks/decode_attention_fp8_gpu.py --plan: one layer, fp8 plan and bf16 default, each with the fused
#      sum and with the reduce kernel, at the split shapes -> $OUT/decode_attention_combine.json;
#   3. where a synchronised step's host time goes (benchmarks/decode_host_time_gpu.py) ->
#      $OUT/decode_host_time.json;
#   4. benchmarks/engine_gpu.py: the decode rows with bf16 and fp8 linears both ways (-reduce), and issue 19's
#      fp8 KV rows (b64 ctx 4,096) both ways in FP8_KV_ROUNDS rounds -> $OUT/engine_gpu_combine.json;
#   5. time left, the fp8 KV step's trace both ways -> $OUT/decode_step_trace_combine.json.
# Carry .whl.   OUT=dir bash benchmarks/split_combine_gpu.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
SWEEP=(--variants kt --tiles 64x2x3 --splits auto)
SHAPES=${SHAPES-b64_ctx4096,b32_ctx4096,b8_ctx4096,b1_ctx4096,b64_ctx512,b1_ctx512}
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"

step "GPU tests + compile (10 processes)"
TESTS=${TESTS-tests/kernels/test_decode_attention.py tests/kernels/test_fp8_kv.py tests/engine/test_fp8_kv_cuda.py \
  tests/engine/test_cuda_graphs.py}
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout 220 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" ${TESTS:---version} \
  >"$OUT/combine_tests.log" 2>&1 &
tests=$!
warms=()
for i in $(seq 0 9); do
  (cd benchmarks && timeout 100 python3 decode_attention_fp8_gpu.py "${SWEEP[@]}" --warm "$i/10") >"$OUT/warm_$i.log" 2>&1 &
  warms+=($!)
done
for pid in "${warms[@]}"; do wait "$pid"; done
cat "$OUT"/warm_*.log 2>/dev/null | grep -v '^$' | head -n 10; rm -f "$OUT"/warm_*.log

step "one layer"
(cd benchmarks && timeout 120 python3 decode_attention_fp8_gpu.py "${SWEEP[@]}" --plan --shapes "$SHAPES" \
  --budget-s 100 --out "$OUT/decode_attention_combine.json") >"$OUT/decode_attention_combine.log" 2>&1
echo "one layer rc $?"; grep -E "^==|plan|dot-" "$OUT/decode_attention_combine.log"

wait "$tests"; echo "tests rc $?"; tail -n 2 "$OUT/combine_tests.log"
grep -h -E "^(FAILED|ERROR)" "$OUT/combine_tests.log" | head -n 10

step "host time"
(cd benchmarks && timeout 90 python3 decode_host_time_gpu.py --out "$OUT/decode_host_time.json") 2>&1 | tail -n 3

step "engine rows"
left=$((560 - (SECONDS - t0)))
(cd benchmarks && timeout "$left" python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 \
  --quantization "${QUANTIZATION-none,none-reduce,fp8,fp8-reduce}" --fp8-kv --fp8-kv-modifiers "${FP8_KV_MODIFIERS-reduce}" \
  --fp8-kv-rounds "${FP8_KV_ROUNDS:-2}" --out "$OUT/engine_gpu_combine.json") >"$OUT/engine_gpu_combine.log" 2>&1
echo "engine rc $?"; grep -E "^(decode_b|prefill_4096)|fp8 KV" "$OUT/engine_gpu_combine.log" | tail -n 40
if [ $((SECONDS - t0)) -lt 520 ]; then
  step "trace"
  (cd benchmarks && timeout $((580 - (SECONDS - t0))) python3 decode_step_trace_gpu.py --runs none-reduce,none \
    --kv fp8 --batches 64 --context 4096 --out "$OUT/decode_step_trace_combine.json") 2>&1 | grep -v Warn | tail -n 4
fi
step "done"
