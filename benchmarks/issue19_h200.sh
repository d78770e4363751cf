#!/usr/bin/env bash
# One device call for issue 19 (fp8 KV cache and fp8 weights) on an H200, after the kv_transfer refactor:
#   1. the GPU tests of the fp8 kernels, the fp8 KV engine, CUDA graphs and the cuda_ipc / tcp-from-CUDA transfers;
#   2. benchmarks/engine_gpu.py: bf16 and fp8 linears (--quantization none,fp8), the fp8 KV rows (bf16 KV, fp8 KV,
#      fp8 KV + fp8 linears at b64 ctx 4096), the cuda_ipc transfer; no HF baseline (engine_gpu_h200.sh has it);
#   3. benchmarks/transfer_backends.py: one 4,096-token llama3-8b KV in bf16 and in fp8, tcp and cuda_ipc;
#   4. benchmarks/serving_gpu.py: ShareGPT all at once, 1P+1D with bf16 KV and with fp8 KV, engine-bound figure.
# JSON and logs land in $OUT. Carry .whl (bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi) and
# .bench_data (the default model's tokenizer files and the ShareGPT sample: see multiturn_reuse_h200.sh).
#   OUT=dir bash benchmarks/issue19_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }

step "GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/kernels/test_fp8_kv.py \
  tests/kernels/test_linear_fp8.py tests/engine/test_fp8_kv_cuda.py tests/kv_transfer/test_cuda_ipc.py \
  tests/kv_transfer/test_tcp_cuda.py tests/kernels/test_block_copy.py tests/engine/test_cuda_graphs.py \
  tests/decode_node/test_decode_engine_cuda.py >"$OUT/issue19_tests_h200.log" 2>&1
tail -n 15 "$OUT/issue19_tests_h200.log"

step "engine rows"
(cd benchmarks && timeout 200 python3 engine_gpu.py --skip-hf --fp8-kv --quantization none,fp8 --repeat 10 \
  --out "$OUT/engine_gpu_fp8_h200.json") >"$OUT/engine_gpu_fp8_h200.log" 2>&1
tail -n 22 "$OUT/engine_gpu_fp8_h200.log"

step "transfer bf16 vs fp8"
timeout 90 python3 benchmarks/transfer_backends.py --presets llama3-8b:bfloat16 llama3-8b:float8_e4m3fn \
  --backends copy tcp cuda_ipc --out "$OUT/transfer_fp8_h200.json" >"$OUT/transfer_fp8_h200.log" 2>&1
grep -E "llama3|skipped|Error" "$OUT/transfer_fp8_h200.log" | tail -n 8

step "serving bf16 KV vs fp8 KV"
left=$((585 - (SECONDS - t0)))
timeout -k 15 $left python3 benchmarks/serving_gpu.py --tokenizer .bench_data/tokenizer \
  --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz --deployments disaggregated disaggregated_fp8kv \
  --poisson-prompts 0 --out "$OUT/serving_gpu_fp8kv_h200.json" >"$OUT/serving_gpu_fp8kv_h200.log" 2>&1
grep -vE "^\s*$" "$OUT/serving_gpu_fp8kv_h200.log" | tail -n 8
step "done"
