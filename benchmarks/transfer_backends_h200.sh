#!/usr/bin/env bash
# benchmarks/transfer_backends.py on the lent GPU machine in one device call: every backend the GPUs run (one
# GPU: P and D share it and nccl is listed as skipped; two: P on cuda:0, D on cuda:1), store over shm and over a
# redis-server, 2 presets x 4 value sizes; JSON and log land in $OUT.
#
#   here, once:   bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi   (.whl: redis-py and the rest the machine lacks)
#                 bash benchmarks/transfer_backends_h200.sh --pack   (.bench_bin: this host's redis-server + libs)
#   device call:  OUT=$OUT bash benchmarks/transfer_backends_h200.sh [ARGS for transfer_backends.py]
#                 with carry [".whl", ".bench_bin"]
#
# The machine has no redis-server and nothing can be fetched there: --pack copies this host's (Debian 12, glibc
# 2.36; the machine's is newer) with the libraries it links beyond glibc, and a wrapper that points only it at them.
set -uo pipefail
if [ "${1:-}" = "--pack" ]; then
  binary=$(command -v redis-server) || { echo "no redis-server on this host"; exit 1; }
  rm -rf .bench_bin && mkdir -p .bench_bin/lib
  cp "$(readlink -f "$binary")" .bench_bin/redis-server.bin
  ldd "$binary" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libpthread|libdl|librt)\.so' \
    | xargs -I{} cp -L {} .bench_bin/lib/
  printf '#!/bin/sh\nd=$(dirname "$0")\nLD_LIBRARY_PATH="$d/lib" exec "$d/redis-server.bin" "$@"\n' \
    >.bench_bin/redis-server
  chmod +x .bench_bin/redis-server
  .bench_bin/redis-server --version && du -sh .bench_bin
  exit
fi
source benchmarks/device_env.sh
export PATH=$PWD/.bench_bin:$PATH
nvidia-smi topo -m >>"$OUT/gpu.csv" 2>&1
redis-server --version >>"$OUT/gpu.csv" 2>&1 || echo "no redis-server: store-redis rows are skipped" | tee -a "$OUT/gpu.csv"
timeout $((570 - (SECONDS - t0))) python3 benchmarks/transfer_backends.py \
  --out "$OUT/transfer_backends_h200.json" "$@" 2>&1 | tee "$OUT/transfer_backends_h200.log"
echo "total: $((SECONDS - t0)) s"
