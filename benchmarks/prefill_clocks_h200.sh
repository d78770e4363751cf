#!/usr/bin/env bash
# benchmarks/prefill_clocks_gpu.py on the H200 in one call (~2 min): back-to-back vs rested 4,096-token prefills
# with NVML's SM clock, power and clock-event reasons; fp8 logits against bf16's; served lengths after the warm-up.
# Carry .whl.   OUT=dir bash benchmarks/prefill_clocks_h200.sh   (writes $OUT/prefill_clocks_h200.json, .log)
set -uo pipefail
source benchmarks/device_env.sh
(cd benchmarks && timeout 300 python3 prefill_clocks_gpu.py --reps 30) 2>&1 | grep --line-buffered -v "^USDT:" \
  | tee "$OUT/prefill_clocks_h200.log"
echo "exit ${PIPESTATUS[0]}; total $((SECONDS - t0)) s" | tee -a "$OUT/prefill_clocks_h200.log"
