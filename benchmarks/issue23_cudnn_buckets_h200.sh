#!/usr/bin/env bash
# Issue 23 item 3 (cuDNN for whole prompts, padded to 256-row buckets that the warm-up plans) and issue 19's fp8
# prefill, in one call (< 560 s on the H200). Carry .whl.   OUT=dir bash benchmarks/issue23_cudnn_buckets_h200.sh
# 1. benchmarks/prefill_sdpa_buckets_gpu.py: one layer's attention, ours vs padded / unpadded cuDNN at lengths on
#    and between buckets, and each length's first call after the warm-up (a plan build would show there);
# 2. benchmarks/prefill_4096_gpu.py: the whole 4,096-token prefill, bf16 and fp8 linears, ours vs cuDNN, plain /
#    queued behind a GPU sleep (the GPU's own time) / rested after one (host delays, no back-to-back load);
# 3. the GPU tests of the warm-up (no Triton compile, no new cuDNN shape after it) and of the SDPA path;
# 4. benchmarks/engine_gpu.py --quantization none,fp8 (the docs' engine rows), with whatever time is left.
# Writes $OUT/run.log, gpu_tests.log, prefill_sdpa_buckets_h200.json, prefill_4096_buckets_gpu.json,
# engine_gpu_cudnn_buckets_h200.json (and device_env.sh's pip.log, gpu.csv): 7 files, the most that come back.
set -uo pipefail
source benchmarks/device_env.sh
left() { echo $((545 - (SECONDS - t0))); }
main() {
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn',
  torch.backends.cudnn.version(), torch.cuda.get_device_name())"
(cd benchmarks && timeout 90 python3 prefill_sdpa_buckets_gpu.py --bucket 256 --min-tokens 1024 --limit 8192)
echo "buckets: exit $? ($((SECONDS - t0)) s)"
timeout 220 python3 benchmarks/prefill_4096_gpu.py --variants ours cudnn ours_queued cudnn_queued ours_rested \
  cudnn_rested fp8_ours fp8_cudnn fp8_ours_queued fp8_cudnn_queued --rounds 4 --reps 5 \
  --profile ours cudnn fp8_ours fp8_cudnn --out-name prefill_4096_buckets_gpu.json
echo "prefill 4096: exit $? ($((SECONDS - t0)) s)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs \
  tests/kernels/test_prefill_attention.py -k "sdpa or padded or dispatcher" >"$OUT/gpu_tests.log" 2>&1
echo "kernel tests: exit $? ($((SECONDS - t0)) s)"; tail -3 "$OUT/gpu_tests.log"
timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations=8 \
  tests/engine/test_prefill_warm_up.py >>"$OUT/gpu_tests.log" 2>&1
echo "warm-up tests: exit $? ($((SECONDS - t0)) s)"; tail -14 "$OUT/gpu_tests.log"
(cd benchmarks && timeout "$(left)" python3 engine_gpu.py --skip-hf --skip-transfer --quantization none,fp8 \
  --repeat 10 --out "$OUT/engine_gpu_cudnn_buckets_h200.json")
echo "engine: exit $? total $((SECONDS - t0)) s"
}
main 2>&1 | grep --line-buffered -v "^USDT:" | tee "$OUT/run.log"
