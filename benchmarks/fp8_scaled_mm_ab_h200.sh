#!/usr/bin/env bash
# The engine's fp8 rows with cuBLASLt's fp8 GEMM from SCALED_MM_MIN_ROWS (kernels/linear_fp8_triton.py) and
# without it (the constant raised past any batch: our Triton GEMM everywhere), alternated on=off=on=off in one
# call, so the prefill 4,096 row's A/B is on the same GPU. Carry .whl.  OUT=dir bash benchmarks/fp8_scaled_mm_ab_h200.sh
set -uo pipefail
source benchmarks/device_env.sh
run() {  # $1: on|off, $2: round
  (cd benchmarks && timeout 100 python3 - "$1" "$2" <<'PY'
import runpy, sys
import pdserve.kernels.linear_fp8_triton as fp8
mode, round_ = sys.argv[1], sys.argv[2]
if mode == "off":
    fp8.SCALED_MM_MIN_ROWS = 1 << 40
out = f"{__import__('os').environ['OUT']}/engine_gpu_fp8_scaledmm_{mode}{round_}_h200.json"
sys.argv = ["engine_gpu.py", "--skip-hf", "--skip-transfer", "--quantization", "fp8", "--repeat", "10", "--out", out]
runpy.run_path("engine_gpu.py", run_name="__main__")
PY
  ) >"$OUT/engine_gpu_fp8_scaledmm_$1$2_h200.log" 2>&1
  echo "$1 round $2 rc $?: $(grep -E '^(prefill_4096|decode_b1_ctx512|decode_b64_ctx512)_fp8_w ' "$OUT/engine_gpu_fp8_scaledmm_$1$2_h200.log" | tr -s ' ' | tr '\n' ';')"
}
for r in 1 2; do run on $r; run off $r; done
