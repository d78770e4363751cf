#!/usr/bin/env bash
# Sets up ./.venv for pdserve. An interpreter that already has torch (a CUDA build on a GPU host) keeps it:
# the venv sees the system site-packages, and torch is installed only where none imports.
# Each step prints one line as it starts and its time when done (about 2 minutes in all on a 2-core machine,
# most of it pip resolving and installing; pip itself stays quiet).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=5
started=$SECONDS
n=0
step() {  # step "what": number it, say it, time the previous one
  n=$((n + 1))
  echo "[setup ${n}/${STEPS}] $1 ..." >&2
  step_start=$SECONDS
}
done_step() { echo "[setup ${n}/${STEPS}] done in $((SECONDS - step_start)) s" >&2; }

step "virtual environment .venv"
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
done_step

step "torch (the CPU wheel, only where no torch imports)"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # the CPU wheel (no multi-GB CUDA download); triton for the kernel tests under TRITON_INTERPRET=1
  .venv/bin/pip install -q torch==2.13.0 triton==3.8.0 numpy
fi
done_step

step "pdserve and its dev dependencies (pip install -e .[dev])"
.venv/bin/pip install -q -e ".[dev]"
done_step

# bytecode for this checkout's own modules: an editable install compiles none, and where PYTHONDONTWRITEBYTECODE
# is set (as on this project's machines) every process compiled what it imported: a worker's 142 modules, ~0.2
# CPU-s of each start (tests/ start ~150 routers and workers); a stale file is recompiled in memory as usual
step "bytecode of pdserve's own modules (compileall)"
.venv/bin/python -m compileall -q -j 0 pdserve engine kernels cache_store router prefill_node decode_node kv_transfer \
  protocol worker bench planner tests benchmarks >/dev/null
done_step

# system packages the tests use: redis-server (the Redis tier, started by the tests on a free port) and
# chromium (the status page rendered headless); installed where missing and we are root on Debian
step "system packages the tests use (redis-server, chromium)"
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "  apt-get install ${missing[*]}" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null
  else
    echo "note: ${missing[*]} not found; the tests that need them will be skipped" >&2
  fi
fi
done_step
echo "[setup] .venv ready in $((SECONDS - started)) s" >&2
