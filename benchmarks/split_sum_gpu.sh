#!/usr/bin/env bash
# One device call for o_proj's and down's split-K partials summed by the next residual norm (kernels/split_sum.py,
# engine/model.py SUM_IN_NORM), before and after:
#   1. the GPU tests of the norm, the linears, PDL, the CUDA graphs and the zero-compile warm-up;
#   2. benchmarks/engine_gpu.py with the tables as committed: fp8 linears with the norm's sum against the reduce
#      kernel (-splitreduce), each twice interleaved, with and without an fp8 cache, and the skinny product's
#      shipped prefetch against none (-noprefetch);
#   3. benchmarks/linear_fp8_skinny_gpu.py over o and down only, timed as the engine now runs them (no reduce
#      kernel) -> kernels/linear_fp8_configs.json (this card's entries);
#   4. the rows again with that table, and the graph and warm-up tests with it.
# The table and JSON come back in $OUT, the logs packed into logs_<card>.tgz (a call returns at most 8 files).
# Carry .whl (bash ../shared/hooks/device-wheels).            OUT=dir bash benchmarks/split_sum_gpu.sh
set -uo pipefail
source benchmarks/device_env.sh
step() { echo "== $1 at $((SECONDS - t0)) s"; }
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
engine() {  # $1: runs, $2: name
  (cd benchmarks && timeout "${3:-150}" python3 engine_gpu.py --skip-hf --skip-transfer --repeat 10 --quantization "$1" \
    --out "$OUT/$2_$card.json") >"$OUT/$2_$card.log" 2>&1
  echo "rc $?"; grep "^run " "$OUT/$2_$card.log" | tr ',' '\n' | grep -E "^run|decode_b(1|64)_ctx512"
}
tests() {  # $1: name, $2: limit, then test files
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -p no:randomly -o addopts="" "$@" >"$OUT/$name.log" 2>&1
  echo "rc $?"; tail -n 1 "$OUT/$name.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/$name.log" | head
}

step "GPU tests ($card)"
tests split_sum_tests 170 tests/kernels/test_split_sum.py tests/kernels/test_rms_norm.py tests/kernels/test_linear_fp8.py \
  tests/kernels/test_linear.py tests/kernels/test_pdl.py tests/engine/test_cuda_graphs.py tests/engine/test_prefill_warm_up.py
step "engine rows, tables as committed"
engine fp8,fp8-splitreduce,fp8-noprefetch,fp8-fp8kv,fp8-fp8kv-splitreduce,fp8,fp8-splitreduce engine_gpu_split_sum
step "o and down swept as summed by the norm"
(cd benchmarks && timeout 150 python3 linear_fp8_skinny_gpu.py --shapes o down --out "$OUT/linear_fp8_skinny_summed_$card.json" \
  --table ../kernels/linear_fp8_configs.json) >"$OUT/linear_fp8_skinny_summed_$card.log" 2>&1
grep -v -i warn "$OUT/linear_fp8_skinny_summed_$card.log" | tail -n 12
cp kernels/linear_fp8_configs.json "$OUT/"
step "engine rows, the new table"
engine fp8,fp8-fp8kv,fp8-splitreduce,fp8 engine_gpu_split_sum_table 100
step "graph and warm-up tests, the new table"
tests split_sum_table_tests 90 tests/engine/test_cuda_graphs.py tests/engine/test_prefill_warm_up.py tests/kernels/test_split_sum.py
(cd "$OUT" && tar czf "logs_$card.tgz" ./*.log && rm -f ./*.log)
step done
