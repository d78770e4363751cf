#!/usr/bin/env bash
# One device call that checks the CUDA paths after a change outside the kernels (e.g. the torch-free model
# facts, the calloc'd CPU pool, the padded cuDNN dispatch): every GPU test file in parallel processes, then the
# engine rows for bf16 and fp8 weights, then a small ShareGPT serving run through `pdserve serve`'s launcher.
#   OUT=dir bash benchmarks/gpu_check_h200.sh      (carry .whl and .bench_data; under ~540 s)
# QUANTIZATION=... picks engine_gpu.py's runs (default none,fp8; e.g. none,fp8,fp8-unfused).
set -uo pipefail
source benchmarks/device_env.sh
left() { echo $((540 - (SECONDS - t0))); }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.csv"
logs=$OUT/tests && mkdir -p "$logs"
for f in tests/kv_transfer/test_cuda_ipc.py tests/kv_transfer/test_tcp_cuda.py tests/cache_store/test_tiered_cuda.py \
         tests/engine/test_model_forward.py tests/engine/test_sampling.py tests/engine/test_weights_fp8.py \
         tests/engine/test_prefill_warm_up.py tests/engine/test_cuda_graphs.py tests/engine/test_prefill_batch.py \
         tests/engine/test_fp8_kv_cuda.py tests/kernels/test_fp8_activation.py tests/kernels/test_linear_fp8.py tests/kernels/test_linear.py \
         tests/kernels/test_prefill_attention.py tests/kernels/test_fp8_kv.py tests/kernels/test_rope.py tests/kernels/test_pdl.py \
         tests/decode_node/test_decode_engine_cuda.py; do
  (timeout 280 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs "$f" >"$logs/$(basename "$f" .py).log" 2>&1
   echo "exit $?" >>"$logs/$(basename "$f" .py).log") &
done
wait
grep -H -E "passed|failed|error|^exit" "$logs"/*.log | grep -v "^.*: *$"
echo "tests: $((SECONDS - t0)) s"
[ -n "${SKIP_ENGINE_AND_SERVING:-}" ] && return 0  # sourced by a script that times its own rows (pdl_h200.sh)
(cd benchmarks && timeout "$(($(left) - 200))" python3 engine_gpu.py --skip-hf --skip-transfer --quantization "${QUANTIZATION:-none,fp8}" \
   --out "$OUT/engine_gpu_check_h200.json") >"$OUT/engine_gpu.log" 2>&1
echo "engine rows: exit $? ($((SECONDS - t0)) s)"; grep -E "prefill_4096|decode_b" "$OUT/engine_gpu.log" | tail -24
timeout "$(left)" python3 benchmarks/serving_gpu.py --tokenizer .bench_data/tokenizer \
  --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz --deployments disaggregated --num-prompts 200 \
  --poisson-prompts 100 --out "$OUT/serving_gpu_check_h200.json" >"$OUT/serving.log" 2>&1
echo "serving: exit $? ($((SECONDS - t0)) s)"; tail -8 "$OUT/serving.log"
