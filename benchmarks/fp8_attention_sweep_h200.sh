#!/usr/bin/env bash
# One device call for issue 19's fp8 decode attention (kernels/decode_attention_triton.py VARIANTS), <= 240 s:
#   1. the GPU tests of decode attention (bf16 and fp8, every variant; 4 pytest processes, one per dtype),
#      in the background while
#   2. 10 processes compile the sweep's kernels into Triton's cache (decode_attention_fp8_gpu.py --warm I/10);
#   3. benchmarks/decode_attention_fp8_gpu.py: variants x tiles at b64 ctx4096, b64 ctx512, b1 ctx4096, bf16
#      beside, each row checked against the reference, into $OUT/decode_attention_fp8_h200.json; the table
#      (best tile per variant, us, TB/s of KV read, x vs bf16) is printed and in $OUT/decode_attention_fp8_h200.log.
# Carry .whl (bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi).  OUT=dir bash benchmarks/fp8_attention_sweep_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }

step "GPU tests (background, 4 processes by dtype) + compile (10 processes)"
tests=()
i=0
for sel in "bfloat16" "float16 and not bfloat16" "float32" "not float16 and not float32"; do
  timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" -k "$sel" \
    tests/kernels/test_decode_attention.py tests/kernels/test_fp8_kv.py >"$OUT/fp8_attention_tests_$i.log" 2>&1 &
  tests+=($!); i=$((i + 1))
done
warms=()
for i in $(seq 0 9); do
  (cd benchmarks && timeout 90 python3 decode_attention_fp8_gpu.py --warm "$i/10") >"$OUT/warm_$i.log" 2>&1 &
  warms+=($!)
done
for pid in "${warms[@]}"; do wait "$pid"; done
step "compiled"
cat "$OUT"/warm_*.log | grep -v '^$' | head -n 20
for i in 0 1 2 3; do wait "${tests[$i]}"; echo "tests $i rc $?"; tail -n 3 "$OUT/fp8_attention_tests_$i.log"; done
grep -h -E "^(FAILED|ERROR)" "$OUT"/fp8_attention_tests_*.log | head -n 20

step "sweep"
left=$((232 - (SECONDS - t0)))
(cd benchmarks && timeout "$left" python3 decode_attention_fp8_gpu.py --budget-s $((left - 25)) \
  --out "$OUT/decode_attention_fp8_h200.json") >"$OUT/decode_attention_fp8_h200.log" 2>&1
echo "sweep rc $?"
grep -v '^$' "$OUT/decode_attention_fp8_h200.log" | tail -n 60
step "done"
