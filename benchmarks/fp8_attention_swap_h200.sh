#!/usr/bin/env bash
# One device call for the fp8 decode attention's fp8-dot variants (kernels/decode_attention_triton.py "swap",
# "swap+pvt", "swap+pvt+pv8", "swap+pv8", against the default "kt"), <= 590 s:
#   1. the GPU tests of decode attention and the fp8 KV engine (background) while 10 processes compile the sweep;
#   2. benchmarks/decode_attention_fp8_gpu.py over those variants x tiles -> $OUT/decode_attention_fp8_swap_h200.json;
#   3. benchmarks/engine_gpu.py: the fp8 KV rows (b64 ctx 4,096) with the default and two swap variants, and the
#      decode rows without PDL and with PDL but no weight prefetch (bf16 and fp8 linears) -> $OUT/engine_gpu_swap_h200.json.
# Carry .whl.   OUT=dir bash benchmarks/fp8_attention_swap_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
VARIANTS=${VARIANTS:-kt,swap,swap+pvt,swap+pvt+pv8,swap+pv8}

step "GPU tests (background) + compile (10 processes)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" tests/kernels/test_fp8_kv.py \
  tests/kernels/test_decode_attention.py tests/engine/test_fp8_kv_cuda.py >"$OUT/fp8_attention_swap_tests.log" 2>&1 &
tests=$!
warms=()
for i in $(seq 0 9); do
  (cd benchmarks && timeout 100 python3 decode_attention_fp8_gpu.py --variants "$VARIANTS" --warm "$i/10") >"$OUT/warm_$i.log" 2>&1 &
  warms+=($!)
done
for pid in "${warms[@]}"; do wait "$pid"; done
step "compiled"
cat "$OUT"/warm_*.log | grep -v '^$' | head -n 20

step "sweep"
(cd benchmarks && timeout 200 python3 decode_attention_fp8_gpu.py --variants "$VARIANTS" --budget-s 170 \
  --out "$OUT/decode_attention_fp8_swap_h200.json") >"$OUT/decode_attention_fp8_swap_h200.log" 2>&1
echo "sweep rc $?"
grep -v '^$' "$OUT/decode_attention_fp8_swap_h200.log" | grep -v "^   failed: .*budget" | tail -n 40
wait "$tests"; echo "tests rc $?"; tail -n 4 "$OUT/fp8_attention_swap_tests.log"
grep -h -E "^(FAILED|ERROR)" "$OUT/fp8_attention_swap_tests.log" | head -n 20

step "engine rows"
left=$((585 - (SECONDS - t0)))
(cd benchmarks && timeout "$left" python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 \
  --quantization fp8-nopdl,fp8-noprefetch,none-nopdl,none-noprefetch --fp8-kv --fp8-kv-variants swap+pvt+pv8,swap+pvt \
  --out "$OUT/engine_gpu_swap_h200.json") >"$OUT/engine_gpu_swap_h200.log" 2>&1
echo "engine rc $?"; grep -E "decode_b|prefill_4096|fp8 KV" "$OUT/engine_gpu_swap_h200.log" | tail -n 30
step "done"
