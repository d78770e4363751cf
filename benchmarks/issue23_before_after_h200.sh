#!/usr/bin/env bash
# One H200 call for issue 23's missing items (logs and JSON in $OUT), within ~540 s including pip:
#   1. prefill: benchmarks/prefill_4096_gpu.py, the 4,096-token llama3-8b prefill by variant (ours, cuDNN SDPA
#      three ways, flash, cuBLASLt), per-kernel profile, GEMM shapes alone        -> prefill_4096_gpu.json
#   2. serving: the same harness (this tree's benchmarks/serving_gpu.py, 1P+1D disaggregated, `pdserve serve`)
#      on the product before issue 23 (.old = `git archive 2787ed3`, main just before merge 9fefd57, which
#      brought c247d19 db050c7 8fa5a79 0c0b43b) and on this tree: ShareGPT all at once and Poisson 20 req/s,
#      a cold Triton cache each, py-spy of every worker for the first 20 s of ShareGPT -> serving_{before,after}.json,
#      issue23_before_after_h200.json (TTFT p50/p99 per tree, compiles_after_warmup, prefill thread's compiler share)
#   OUT=dir bash benchmarks/issue23_before_after_h200.sh [prefill] [serving]     (default: both, in that order)
# Carry .whl (../shared/hooks/device-wheels xgrammar apache-tvm-ffi), .bench_data (tokenizer + ShareGPT sample:
# see multiturn_reuse_h200.sh) and .old:  mkdir -p .old && git archive 2787ed3 | tar -x -C .old
# Workload knobs (the same for both trees): NUM_PROMPTS (1000), POISSON_PROMPTS (300), RATE (20).
set -uo pipefail
source benchmarks/device_env.sh
left() { echo $((540 - (SECONDS - t0))); }
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(prefill serving)
python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, sys.version)" \
  | tee -a "$OUT/gpu.csv"
before_commit=2787ed3
workload=(--num-prompts "${NUM_PROMPTS:-1000}" --poisson-prompts "${POISSON_PROMPTS:-300}" --rate "${RATE:-20}")
for part in "${parts[@]}"; do
  case $part in
    prefill)
      timeout -k 10 "$(( $(left) < 130 ? $(left) : 130 ))" python3 benchmarks/prefill_4096_gpu.py 2>&1 \
        | tee "$OUT/prefill_4096.log"
      echo "prefill: $((SECONDS - t0)) s" ;;
    serving)
      [ -f .old/pyproject.toml ] || { echo "no .old tree (carry .old)"; continue; }
      rm -rf /tmp/old_pkg /tmp/triton_before /tmp/triton_after
      python3 benchmarks/tree_link.py .old /tmp/old_pkg 2>&1 | tee "$OUT/old_tree.txt"
      grep -c BLOCK_B .old/kernels/prefill_attention_triton.py | sed 's/^/BLOCK_B mentions in the old kernel: /' \
        | tee -a "$OUT/old_tree.txt"
      data=(--tokenizer .bench_data/tokenizer --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz
            --deployments disaggregated --no-engine-bound "${workload[@]}")
      # each tree gets half of what is left (the report still comes if one is cut off; serving_gpu.py stops its
      # deployment on timeout's SIGTERM, so a cut-off tree leaves no workers holding the GPU)
      half=$(( ($(left) - 15) / 2 ))
      timeout -k 45 "$half" python3 benchmarks/serving_gpu.py "${data[@]}" --product /tmp/old_pkg --port 8741 \
        --triton-cache /tmp/triton_before --py-spy "$OUT/spy_before" --out "$OUT/serving_before.json" 2>&1 \
        | tee "$OUT/serving_before.log"
      echo "serving before: $((SECONDS - t0)) s"
      timeout -k 45 "$(( $(left) - 10 ))" python3 benchmarks/serving_gpu.py "${data[@]}" --port 8751 \
        --triton-cache /tmp/triton_after --py-spy "$OUT/spy_after" --out "$OUT/serving_after.json" 2>&1 \
        | tee "$OUT/serving_after.log"
      echo "serving after: $((SECONDS - t0)) s"
      python3 benchmarks/before_after_report.py --before "$OUT/serving_before.json" --after "$OUT/serving_after.json" \
        --before-spy "$OUT/spy_before" --after-spy "$OUT/spy_after" --before-commit "$before_commit" \
        --after-commit "${AFTER_COMMIT:-this tree}" --out "$OUT/issue23_before_after_h200.json" \
        2>&1 | tee -a "$OUT/serving_after.log" ;;
    *) echo "unknown part $part (prefill, serving)"; exit 2 ;;
  esac
done
echo "total: $((SECONDS - t0)) s"
