#!/usr/bin/env bash
# One device call for issue 22 item 4 on an H200: benchmarks/multiturn_reuse.py --gpu, i.e. today's path, the
# decode prefix cache + delta transfer, and + conditional disaggregation, one `pdserve serve` (1 P + 1 D on the
# GPU, KV by cuda_ipc) after the other on the same 64 ShareGPT conversations (dummy llama3-8b bf16, 4 turns at
# most, answers up to 256 tokens: ~90% of the prompt tokens of turns >= 2 are history), with the engine-bound
# figure for the same waves. JSON, log and the deployments' logs land in $OUT.
#   OUT=dir bash benchmarks/multiturn_reuse_h200.sh [ARGS]     ARGS go to multiturn_reuse.py (--conversations 128,
#                                                               --rows today local, --no-engine-bound, ...)
# Carry .whl and .bench_data with the call (run(carry=[".whl", ".bench_data"])); the device gets neither
# ../shared nor the model cache. From the repository root, once:
#   bash ../shared/hooks/device-wheels
#   mkdir -p .bench_data/tokenizer && cp ~/.cache/pdserve/models/smollm2-135m-instruct-*/tokenizer*.json \
#     .bench_data/tokenizer/ && cp ../shared/data/sharegpt_v3_sample2k.json.gz .bench_data/
# The result goes to benchmarks/results/multiturn_reuse_h200.json (copy it from $OUT) and its figures into
# docs/kv_cache.md's "Measured" part of the decode-side section.
set -uo pipefail
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.csv" 2>&1
timeout $((585 - (SECONDS - t0))) python3 benchmarks/multiturn_reuse.py --gpu --tokenizer .bench_data/tokenizer \
  --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz --out "$OUT/multiturn_reuse_h200.json" --logs "$OUT/logs" "$@" \
  2>&1 | tee "$OUT/multiturn_reuse_h200.log"
echo "total: $((SECONDS - t0)) s"
