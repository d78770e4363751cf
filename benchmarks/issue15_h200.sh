#!/usr/bin/env bash
# Device calls for issue 15 on the H200 (logs and JSON land in $OUT):
#   OUT=dir bash benchmarks/issue15_h200.sh tests            the GPU tests (issue 23's list + the overlapped loop)
#   OUT=dir bash benchmarks/issue15_h200.sh serving [ARGS]   benchmarks/serving_gpu.py ARGS (ShareGPT + Poisson)
# Needs .whl (shared/hooks/device-wheels xgrammar apache-tvm-ffi) and .bench_data (the default model's tokenizer files and the ShareGPT
# sample: the device gets neither ../shared nor the model cache) carried with the call.
set -uo pipefail
source benchmarks/device_env.sh
stage=${1:?tests or serving}
shift
case $stage in
  tests)
    (timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/decode_node/test_decode_engine_cuda.py \
       >"$OUT/decode_engine_cuda.log" 2>&1; echo "exit $?" >>"$OUT/decode_engine_cuda.log") &
    bash benchmarks/issue23_h200.sh tests
    wait
    tail -5 "$OUT/decode_engine_cuda.log" ;;
  serving)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.csv" 2>&1
    timeout $((580 - (SECONDS - t0))) python3 benchmarks/serving_gpu.py --tokenizer .bench_data/tokenizer \
      --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz --out "$OUT/serving_gpu_h200.json" "$@" 2>&1 \
      | tee "$OUT/serving_gpu_h200.log" ;;
  final)  # the GPU tests of the last changes, the structured-output step cost (issue 17), then the serving run
    for f in tests/decode_node/test_decode_engine_cuda.py tests/kv_transfer/test_cuda_ipc.py \
             tests/engine/test_cuda_graphs.py tests/engine/test_model_forward.py tests/engine/test_sampling.py; do
      (timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs "$f" >"/tmp/$(basename "$f").log" 2>&1;
       echo "exit $?" >>"/tmp/$(basename "$f").log") &
    done
    wait
    for f in /tmp/test_*.log; do echo "== $f"; tail -15 "$f"; done >"$OUT/gpu_tests.log"
    grep -h -E "passed|failed|^exit" /tmp/test_*.log
    timeout 120 python3 benchmarks/structured_outputs.py --device cuda --load-format dummy --model-preset llama3-8b \
      --repeats 30 --out "$OUT/structured_outputs_h200.json" 2>&1 | tail -12
    timeout $((585 - (SECONDS - t0))) python3 benchmarks/serving_gpu.py --tokenizer .bench_data/tokenizer \
      --sharegpt .bench_data/sharegpt_v3_sample2k.json.gz --out "$OUT/serving_gpu_h200.json" --py-spy "$OUT/spy" "$@" \
      2>&1 | tee "$OUT/serving_gpu_h200.log" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
echo "total: $((SECONDS - t0)) s"
