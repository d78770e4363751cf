#!/usr/bin/env bash
# One device call for programmatic dependent launch (kernels/pdl.py): every GPU test file (gpu_check_h200.sh's
# list), engine_gpu.py's rows with and without PDL and without the weight prefetch in one run, the decode step's
# kernel trace with and without it, then the ShareGPT serving check through `pdserve serve`'s launcher.
#   OUT=dir bash benchmarks/pdl_h200.sh      (carry .whl and .bench_data; under ~580 s)
set -uo pipefail
export PDSERVE_PDL=1  # kernels/pdl.py (its default since 2026-12-05): every GPU test file and the served workers with PDL
SKIP_ENGINE_AND_SERVING=1 source benchmarks/gpu_check_h200.sh
(cd benchmarks && timeout 240 python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 \
   --quantization fp8-nopdl,fp8,fp8-prefetch,none-nopdl,none --out "$OUT/engine_gpu_pdl_h200.json") >"$OUT/engine_gpu.log" 2>&1
echo "engine rows: exit $? ($((SECONDS - t0)) s)"; grep -E "prefill_4096|decode_b" "$OUT/engine_gpu.log" | tail -30
timeout 100 python3 benchmarks/decode_step_trace_gpu.py --out "$OUT/decode_step_trace_h200.json" >"$OUT/trace.log" 2>&1
echo "trace: exit $? ($((SECONDS - t0)) s)"; tail -8 "$OUT/trace.log" | cut -c1-400
timeout "$((575 - (SECONDS - t0)))" python3 benchmarks/serving_gpu.py --tokenizer .bench_data/tokenizer \
  --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz --deployments disaggregated --num-prompts 200 \
  --poisson-prompts 100 --out "$OUT/serving_gpu_pdl_h200.json" >"$OUT/serving.log" 2>&1
echo "serving: exit $? ($((SECONDS - t0)) s)"; tail -8 "$OUT/serving.log"
