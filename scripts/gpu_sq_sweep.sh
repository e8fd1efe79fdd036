#!/usr/bin/env bash
# Issue 3 on the GPU, one call: SmoothQuant calibration variants on full WikiText-2 (gpu_sq_sweep.py),
# the KV group-size sweep on full WikiText-2, and full LAMBADA with the checkpoint of variant $TASK_VARIANT.
#   GGUF=/tmp/smol.gguf DATA=.evaldata OUT=/tmp/sw VARIANTS="s128:128:default ..." scripts/gpu_sq_sweep.sh
set -u
OUT=${OUT:-sweep_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
VARIANTS=${VARIANTS:-s128:128:default s128-coarse:128:coarse}
timeout ${SWEEP_CAP:-300} python scripts/gpu_sq_sweep.py --gguf "$GGUF" --data "$DATA" --out "$OUT" \
  --variants $VARIANTS 2>&1 | grep -v -i warn | tee "$OUT/sweep.log" | tail -12
timeout ${KV_CAP:-90} eightbit eval ppl --model "$GGUF" --device cuda --data-dir "$DATA" --configs kv-sweep \
  --out "$OUT/kv" --no-progress 2>&1 | grep -v -i warn | tail -9
timeout ${TASKS_CAP:-150} eightbit eval tasks --model "$GGUF" --device cuda --data-dir "$DATA" \
  --sq-checkpoint "/tmp/sq-${TASK_VARIANT:-s128}" --configs bf16,kv8,w8a8-sq+kv8 --tasks ${TASKS:-lambada} \
  --out "$OUT/tasks" --no-progress 2>&1 | grep -v -i warn | tail -8
