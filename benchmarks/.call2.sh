source benchmarks/device_env.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/kernels/test_linear_fp8.py tests/engine/test_cuda_graphs.py >"$OUT/fp8_skinny_tests_h200.log" 2>&1; tail -n 4 "$OUT/fp8_skinny_tests_h200.log"
(cd benchmarks && timeout 300 python3 engine_gpu.py --skip-hf --skip-transfer --quantization none,fp8 --repeat 10 --out "$OUT/engine_gpu_fp8w_h200.json") >"$OUT/engine_gpu_fp8w_h200.log" 2>&1
tail -n 30 "$OUT/engine_gpu_fp8w_h200.log"
