#!/usr/bin/env bash
# Sets up ./.venv for pdserve. An interpreter that already has torch (a CUDA build on a GPU host) keeps it:
# the venv sees the system site-packages, and torch is installed only where none imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # the CPU wheel (no multi-GB CUDA download); triton for the kernel tests under TRITON_INTERPRET=1
  .venv/bin/pip install -q torch==2.13.0 triton==3.8.0 numpy
fi
.venv/bin/pip install -q -e ".[dev]"
# system packages the tests use: redis-server (the Redis tier, started by the tests on a free port) and
# chromium (the status page rendered headless); installed where missing and we are root on Debian
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null
  else
    echo "note: ${missing[*]} not found; the tests that need them will be skipped" >&2
  fi
fi
