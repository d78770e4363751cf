#!/usr/bin/env bash
# One device call for issues 19 and 23's remaining targets on the current tree, <= 560 s after the wheels:
#   1. the fp8 GPU tests (engine over an fp8 pool, fp8 kernels, decode attention) while 10 processes compile
#      the sweep's kernels;
#   2. benchmarks/decode_attention_fp8_gpu.py: kt (V [Hkv, D, PAGE]) at one-stage tiles x split counts, bf16's
#      tiles at the same splits, the launcher's own plan -> $OUT/decode_attention_fp8_splits.json;
#   3. benchmarks/engine_gpu.py: decode b1/b8/b64 ctx 512, b1 ctx 4,096, prefill 4,096 with bf16 and fp8
#      linears, and the fp8 KV rows (b64 ctx 4,096; fp8_plan against one 128x4x1 tile) -> $OUT/engine_gpu_targets.json.
# Carry .whl.   OUT=dir bash benchmarks/targets_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
TILES=${TILES:-128x4x1,64x2x1}
SPLITS=${SPLITS:-auto,2,4}
python3 -c "import torch, triton; from pdserve.kernels import decode_attention_triton as a
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, '| fp8 KV default:', a._FP8_VARIANT, a._FP8_TILE)"

step "GPU tests + compile (10 processes)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" tests/kernels/test_fp8_kv.py \
  tests/engine/test_fp8_kv_cuda.py tests/kernels/test_decode_attention.py >"$OUT/targets_tests.log" 2>&1 &
tests=$!
warms=()
for i in $(seq 0 9); do
  (cd benchmarks && timeout 100 python3 decode_attention_fp8_gpu.py --variants kt --tiles "$TILES" --splits "$SPLITS" \
    --warm "$i/10") >"$OUT/warm_$i.log" 2>&1 &
  warms+=($!)
done
for pid in "${warms[@]}"; do wait "$pid"; done
cat "$OUT"/warm_*.log | grep -v '^$' | head -n 10; rm -f "$OUT"/warm_*.log
wait "$tests"; echo "tests rc $?"; tail -n 2 "$OUT/targets_tests.log"
grep -h -E "^(FAILED|ERROR)" "$OUT/targets_tests.log" | head -n 10

step "sweep"
(cd benchmarks && timeout 120 python3 decode_attention_fp8_gpu.py --variants kt --tiles "$TILES" --splits "$SPLITS" \
  --plan --budget-s 100 --out "$OUT/decode_attention_fp8_splits.json") >"$OUT/decode_attention_fp8_splits.log" 2>&1
echo "sweep rc $?"; grep -E "^==|plan:|splits " "$OUT/decode_attention_fp8_splits.log" | tail -n 24

step "engine rows"
left=$((585 - (SECONDS - t0)))
(cd benchmarks && timeout "$left" python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 --quantization none,fp8 \
  --fp8-kv --fp8-kv-variants "${ENGINE_VARIANTS:-kt@128x4x1}" --out "$OUT/engine_gpu_targets.json") >"$OUT/engine_gpu_targets.log" 2>&1
echo "engine rc $?"; grep -E "decode_b|prefill_4096|fp8 KV" "$OUT/engine_gpu_targets.log" | tail -n 24
step "done"
