#!/usr/bin/env bash
# One device call for the fp8 cache's V layout ([Hkv, D, PAGE] a block, kernels/fp8.py), <= 200 s after the
# wheels: the fp8 GPU tests (the engine over an fp8 pool against its references, every fp8 kernel against its
# reference on caches in the layout), then benchmarks/engine_gpu.py's fp8 KV rows (bf16 KV against fp8 KV,
# b64 ctx 4,096) -> $OUT/engine_gpu_fp8_v_layout.json. Carry .whl.   OUT=dir bash benchmarks/fp8_v_layout_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/test_fp8_kv_cuda.py tests/kernels/test_fp8_kv.py \
  >"$OUT/fp8_v_layout_tests.log" 2>&1; echo "tests rc $?"; tail -n 3 "$OUT/fp8_v_layout_tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/fp8_v_layout_tests.log" | head -n 10
(cd benchmarks && timeout 90 python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 --quantization '' --fp8-kv \
  --out "$OUT/engine_gpu_fp8_v_layout.json") >"$OUT/engine_gpu_fp8_v_layout.log" 2>&1
echo "engine rc $?"; grep -E "fp8 KV" "$OUT/engine_gpu_fp8_v_layout.log" | tail -n 3
