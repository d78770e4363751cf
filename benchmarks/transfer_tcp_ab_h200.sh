#!/usr/bin/env bash
# The tcp KV transfer before and after a change, alternating in one device call (base, change, base, change:
# the machine's drift shows in the pairs), on the GPU tests of the transfer first. The base is the change's
# files as they were, in BASE (a copy of the same paths, e.g. filled with `git show BASE_COMMIT:path`), laid
# over this checkout for the base runs and put back after.
#
#   here:         mkdir -p .bench_base && for f in $(git diff --name-only --diff-filter=M BASE_COMMIT -- kv_transfer kernels); do
#                   mkdir -p .bench_base/$(dirname $f); git show BASE_COMMIT:$f > .bench_base/$f; done
#   device call:  OUT=$OUT BASE=.bench_base [ROUNDS=2] bash benchmarks/transfer_tcp_ab_h200.sh   with carry [".whl", ".bench_base"]
#
# ALT (optional) names a folder of a third variant's files, laid over the change for "alt" runs (a change not
# kept, from its commit: `git show COMMIT:path > .bench_alt/path`): base, change and alt then alternate.
# TESTS=0 skips the GPU tests (a second call on a warm machine that already ran them).
set -uo pipefail
source benchmarks/device_env.sh
: "${BASE:?set BASE to the folder holding the base versions of the changed files}"
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kv_transfer/test_tcp_cuda.py tests/kv_transfer/test_tcp.py \
  tests/kv_transfer/test_payload_reader.py tests/kv_transfer/test_wire.py tests/kv_transfer/test_fp8_transfer.py \
  tests/kv_transfer/test_cuda_ipc.py tests/kv_transfer/test_checksum.py tests/kv_transfer/test_store_cuda.py \
  tests/kernels/test_block_copy.py >"$OUT/transfer_ab_gpu_tests.log" 2>&1
[ "${TESTS:-1}" = 0 ] || tail -3 "$OUT/transfer_ab_gpu_tests.log"
files=$(cd "$BASE" && find . -type f -name '*.py')
alt_files=$([ -n "${ALT:-}" ] && cd "$ALT" && find . -type f -name '*.py')
mkdir -p /tmp/change && for f in $files $alt_files; do mkdir -p "/tmp/change/$(dirname "$f")"; cp "$f" "/tmp/change/$f"; done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in base change ${ALT:+alt}; do
    for f in $files $alt_files; do cp "/tmp/change/$f" "$f"; done
    if [ $side = base ]; then for f in $files; do cp "$BASE/$f" "$f"; done; fi
    if [ $side = alt ]; then for f in $alt_files; do cp "$ALT/$f" "$f"; done; fi
    timeout $((560 - (SECONDS - t0))) python3 benchmarks/transfer_backends.py \
      --presets llama3-8b:bfloat16 llama3-8b:float8_e4m3fn --backends copy tcp --repeat 10 \
      --out "$OUT/transfer_tcp_${side}_${round}.json" 2>&1 | grep -E "tcp|copy" | sed "s/^/$side $round: /"
  done
done
for f in $files $alt_files; do cp "/tmp/change/$f" "$f"; done
