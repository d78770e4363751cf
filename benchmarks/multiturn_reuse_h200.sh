#!/usr/bin/env bash
# One device call for issue 22 item 4 on an H200: benchmarks/multiturn_reuse.py --gpu, i.e. today's path, the
# decode prefix cache + delta transfer, and + conditional disaggregation, one `pdserve serve` (1 P + 1 D on the
# GPU, KV by cuda_ipc) after the other on the same 64 ShareGPT conversations (dummy llama3-8b bf16, 4 turns at
# most, answers up to 256 tokens: ~90% of the prompt tokens of turns >= 2 are history), all of a turn at once and
# with the engine-bound figure; then 32 of them at 8 requests in flight. JSON, logs, deployments' logs in $OUT.
#   OUT=dir bash benchmarks/multiturn_reuse_h200.sh [ARGS]     ARGS go to multiturn_reuse.py (--conversations 128,
#                                                               --rows today local, --no-engine-bound, ...)
# Carry .whl and .bench_data with the call (run(carry=[".whl", ".bench_data"])); the device gets neither
# ../shared nor the model cache. From the repository root, once:
#   bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi    (the workers import xgrammar)
#   mkdir -p .bench_data/tokenizer && cp ~/.cache/pdserve/models/smollm2-135m-instruct-*/tokenizer*.json \
#     .bench_data/tokenizer/ && cp ../shared/data/sharegpt_v3_sample2k.json.gz .bench_data/
# Then: copy $OUT/multiturn_reuse_h200.json (and _c8.json) to benchmarks/results/, regenerate the performance tables
# (.venv/bin/pdserve docs performance --write README.md, and docs/benchmarks.md), and put the figures into
# docs/kv_cache.md's decode-side section (its "H200" line).
set -uo pipefail
source benchmarks/device_env.sh
data=(--tokenizer .bench_data/tokenizer --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz)
# 1. every conversation's turn at once (64 in flight): TTFT under a burst, throughput, the engine-bound figure
timeout -k 20 $((380 - (SECONDS - t0))) python3 benchmarks/multiturn_reuse.py --gpu "${data[@]}" \
  --out "$OUT/multiturn_reuse_h200.json" --logs "$OUT/logs" "$@" 2>&1 | tee "$OUT/multiturn_reuse_h200.log"
# 2. the same paths at 8 requests in flight (32 conversations): TTFT when the prefill compute does not queue
timeout -k 20 $((560 - (SECONDS - t0))) python3 benchmarks/multiturn_reuse.py --gpu "${data[@]}" --conversations 32 \
  --max-concurrency 8 --no-engine-bound --port 8752 --out "$OUT/multiturn_reuse_h200_c8.json" --logs "$OUT/logs_c8" \
  "$@" 2>&1 | tee "$OUT/multiturn_reuse_h200_c8.log"
echo "total: $((SECONDS - t0)) s"
