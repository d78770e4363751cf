#!/usr/bin/env bash
# Issue 16's fault tests on a host with the cores the deployment is for: tests/reliability's worker-failure and
# stalled-step modules on the H200 machine's 16 CPU cores (the GPU hidden: the same CPU deployment as CI's, five
# model processes of one torch thread each, but a core each instead of 2 cores for all). There
# test_worker_failures.check_new_requests also asserts that new requests get their first token within 1 s of a
# kill (ENOUGH_CORES). Writes $OUT/reliability_h200_host.log (the RELIABILITY lines are the measurements).
#
# The default model's GGUF (98 MB) is over one call's carry, so it goes in two calls while the machine is warm:
#   split:  head -c 39845888 GGUF > .gguf_a; tail -c +39845889 GGUF > .gguf_b   (GGUF: ~/.cache/pdserve/gguf/...)
#   call 1 (any script), carry .whl .gguf_a, its command starting with: mv .gguf_a /tmp/gguf_a;
#   call 2, carry .gguf_b .whl2: bash benchmarks/reliability_h200_host.sh
# .whl2 holds what the tests import beyond .whl (cp312 wheels, no dependencies):
#   pip download --no-deps -d .whl2 openai==3.57.0 httpx2 httpcore2 truststore distro tqdm
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl2 jiter
set -uo pipefail
source benchmarks/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl2/*.whl >>"$OUT/pip.log" 2>&1 \
  || { tail "$OUT/pip.log"; exit 1; }
gguf=~/.cache/pdserve/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$(dirname "$gguf")"
[ -f "$gguf" ] || cat /tmp/gguf_a "$([ -f .gguf_b ] && echo .gguf_b || echo /tmp/gguf_b)" > "$gguf"
ls -l "$gguf"
echo "cores: $(nproc)"
CUDA_VISIBLE_DEVICES= timeout $((560 - (SECONDS - t0))) python3 -m pytest -q -o addopts="-ra -s" -p no:randomly \
  tests/reliability/test_worker_failures.py tests/reliability/test_stalled_steps.py >"$OUT/reliability_h200_host.log" 2>&1
echo "pytest rc=$?"
grep -E "RELIABILITY|passed|failed|Error" "$OUT/reliability_h200_host.log" | tail -20
