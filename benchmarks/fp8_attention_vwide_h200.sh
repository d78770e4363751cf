#!/usr/bin/env bash
# One device call for the fp8 decode attention's "vwide" variants (kernels/decode_attention_triton.py: the fp8 V
# tile widened to fp16 in registers as loaded, so its dot operand is laid out from fp16 with ldmatrix.trans,
# instead of from the fp8 bytes one ld.shared.b8 per element), against the default "kt", <= 480 s (the run of
# 2026-12-06 had kt+vwide@64x4x3 as the default and kt@128x4x2 as the A/B: results/*_vwide_h100.*):
#   1. the GPU tests of decode attention, the fp8 KV engine and the CUDA graphs while 10 processes compile the
#      sweep's kernels; both finish before anything is timed;
#   2. benchmarks/decode_attention_fp8_gpu.py over those variants x tiles -> $OUT/decode_attention_fp8_vwide_h200.json;
#   3. benchmarks/engine_gpu.py: the fp8 KV rows (b64 ctx 4,096) with the default and
#      the other variants/tiles in the same run -> $OUT/engine_gpu_vwide_h200.json.
# Carry .whl.   OUT=dir bash benchmarks/fp8_attention_vwide_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
VARIANTS=${VARIANTS:-kt,kt+vwide}
ENGINE_VARIANTS=${ENGINE_VARIANTS:-kt+vwide@64x4x3,kt+vwide@128x4x2}
python3 -c "import torch, triton; from pdserve.kernels import decode_attention_triton as a
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, '| fp8 KV default:', a._FP8_VARIANT, a._FP8_TILE)"
echo "swept: $VARIANTS; engine rows also: $ENGINE_VARIANTS"

step "GPU tests + compile (10 processes)"
TESTS=${TESTS:-tests/kernels/test_fp8_kv.py tests/kernels/test_decode_attention.py tests/engine/test_fp8_kv_cuda.py \
  tests/engine/test_cuda_graphs.py tests/kernels/test_pdl.py}
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" $TESTS \
  >"$OUT/fp8_attention_vwide_tests.log" 2>&1 &
tests=$!
warms=()
for i in $(seq 0 9); do
  (cd benchmarks && timeout 100 python3 decode_attention_fp8_gpu.py --variants "$VARIANTS" --warm "$i/10") >"$OUT/warm_$i.log" 2>&1 &
  warms+=($!)
done
for pid in "${warms[@]}"; do wait "$pid"; done
step "compiled"
cat "$OUT"/warm_*.log | grep -v '^$' | head -n 20
rm -f "$OUT"/warm_*.log
wait "$tests"; echo "tests rc $?"; tail -n 4 "$OUT/fp8_attention_vwide_tests.log"
grep -h -E "^(FAILED|ERROR)" "$OUT/fp8_attention_vwide_tests.log" | head -n 20

step "sweep"
(cd benchmarks && timeout 130 python3 decode_attention_fp8_gpu.py --variants "$VARIANTS" --budget-s 100 \
  --out "$OUT/decode_attention_fp8_vwide_h200.json") >"$OUT/decode_attention_fp8_vwide_h200.log" 2>&1
echo "sweep rc $?"
grep -v '^$' "$OUT/decode_attention_fp8_vwide_h200.log" | grep -v "^   failed: .*budget" | tail -n 30

step "engine rows"
left=$((590 - (SECONDS - t0)))
(cd benchmarks && timeout "$left" python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 \
  --quantization "${QUANTIZATION:-}" --fp8-kv --fp8-kv-variants "$ENGINE_VARIANTS" \
  --out "$OUT/engine_gpu_vwide_h200.json") >"$OUT/engine_gpu_vwide_h200.log" 2>&1
echo "engine rc $?"; grep -E "decode_b|prefill_4096|fp8 KV" "$OUT/engine_gpu_vwide_h200.log" | tail -n 30
step "done"
