#!/usr/bin/env bash
# Where a tcp KV transfer's time goes on the lent GPU host, in one device call: the transfer GPU tests, the tcp
# and store-shm rows with D's per-layer times (d_first_layer_ms, d_last_layer_ms), then py-spy over both
# processes (D and its P child) for a bf16 and an fp8 4,096-token llama3-8b KV, raw stacks with thread names
# and idle samples (what each thread waits on counts too).
#
#   here, once:   bash ../shared/hooks/device-wheels          (.whl: py-spy and the rest the machine lacks)
#   device call:  OUT=$OUT bash benchmarks/transfer_tcp_profile_h200.sh       with carry [".whl"]
#   then here:    python benchmarks/pyspy_threads.py $OUT/tcp_prof_*.txt --rate 250 --frames wait_and_sum read_payload
#                 (results/transfer_tcp_profile_h100.json: the first run, on an H100 host)
set -uo pipefail
source benchmarks/device_env.sh
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kv_transfer/test_store_cuda.py \
  tests/kv_transfer/test_tcp_cuda.py tests/kv_transfer/test_fp8_transfer.py -k "not redis" \
  >"$OUT/transfer_profile_gpu_tests.log" 2>&1
tail -3 "$OUT/transfer_profile_gpu_tests.log"
timeout $((560 - (SECONDS - t0))) python3 benchmarks/transfer_backends.py \
  --presets llama3-8b:bfloat16 llama3-8b:float8_e4m3fn --backends copy tcp store-shm --chunk-mib 16 --repeat 10 \
  --out "$OUT/transfer_tcp_layers_h200.json" 2>&1 | grep -E "tcp|copy|store|failed"
for preset in bfloat16 float8_e4m3fn; do
  timeout $((560 - (SECONDS - t0))) /tmp/site/bin/py-spy record --subprocesses --threads --idle --format raw \
    -r 250 -o "$OUT/tcp_prof_$preset.txt" -- python3 benchmarks/transfer_backends.py \
    --presets "llama3-8b:$preset" --backends tcp --repeat 8 --out "$OUT/transfer_tcp_prof_$preset.json" \
    >"$OUT/tcp_prof_$preset.log" 2>&1
  tail -2 "$OUT/tcp_prof_$preset.log"
done
