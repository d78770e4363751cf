#!/usr/bin/env bash
# One device call for issue 6's engine numbers: the GPU-only tests of graphs and cuda_ipc first, then
# benchmarks/engine_gpu.py (correctness checks, ours vs HF, cuda_ipc vs a device copy); logs and JSON land in $OUT.
#   OUT=/some/dir bash benchmarks/engine_gpu_h200.sh            (run from the repository root on the H200)
# The default model for --parity must be in ~/.cache/pdserve (`pdserve model fetch`, or carried there): the
# machine has no network. Without it the run goes on with --parity off and says so.
set -uo pipefail
# -o addopts="": the device has no pytest-rerunfailures, which pyproject's --reruns needs
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1
t0=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >"$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.csv"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/test_cuda_graphs.py tests/kv_transfer/test_cuda_ipc.py \
  tests/kernels/test_block_copy.py tests/kv_transfer/test_tcp_cuda.py 2>&1 | tee "$OUT/engine_gpu_tests.log" | tail -n 15
parity=()
python3 -c "import sys; from pdserve.engine.weights.fetch import default_cache_dir
d = default_cache_dir(); sys.exit(0 if any((d / 'gguf').glob('*.gguf')) or any((d / 'models').glob('*/')) else 1)" \
  && parity=(--parity) || echo "no cached default model: --parity off"
echo "tests: $((SECONDS - t0)) s"
timeout $((580 - (SECONDS - t0))) python3 benchmarks/engine_gpu.py "${parity[@]}" --out "$OUT/engine_gpu_h200.json" 2>&1 \
  | tee "$OUT/engine_gpu_h200.log"
echo "total: $((SECONDS - t0)) s"
