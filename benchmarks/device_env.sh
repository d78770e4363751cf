# Sourced by the benchmarks/*_h200.sh device scripts, from the repository root on the lent GPU machine: the
# wheels it lacks (.whl, carried with the call: bash ../shared/hooks/device-wheels xgrammar apache-tvm-ffi) into
# /tmp/site, then pdserve itself as an editable install; the machine's own torch and triton are kept.
# Needs OUT (the folder whose pip.log says what went wrong); sets t0 for the scripts' own time limits.
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.csv" 2>&1
