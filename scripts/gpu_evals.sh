#!/usr/bin/env bash
# Issue 3's evals on the GPU: full WikiText-2 perplexity and the task sets, every configuration in one
# process per command. Needs the SmolLM2 GGUF at $GGUF and the data folder at $DATA (shared/data's layout).
#   GGUF=/tmp/smol.gguf DATA=.evaldata OUT=/tmp/ev scripts/gpu_evals.sh
set -u
OUT=${OUT:-eval_out}; mkdir -p "$OUT"
SQ=${SQ:-/tmp/sq-checkpoint}
export EIGHTBIT_CALIB_DATA="$DATA/wikitext-2/wiki.valid.raw" PYTHONUNBUFFERED=1
PPL_CONFIGS=${PPL_CONFIGS:-default,kv-sweep}
TASK_CONFIGS=${TASK_CONFIGS:-bf16,kv8,w8a8-sq+kv8}
if [ ! -d "$SQ" ]; then
  timeout ${QUANT_CAP:-240} eightbit quantize "$GGUF" "$SQ" --num-samples ${SAMPLES:-64} --no-progress 2>&1 | tail -3
fi
if [ ! -d "$SQ" ]; then  # no SmoothQuant checkpoint: measure everything else
  echo "### no SmoothQuant checkpoint: w8a8-sq configurations skipped"
  PPL_CONFIGS=fp32,bf16,kv8,kv8-g8,kv8-g16,kv8-g64,w8a8-rtn,w8a8-rtn+kv8,hf-fp32,hf-bf16,bnb-int8,torchao-int8
  TASK_CONFIGS=bf16,kv8,w8a8-rtn+kv8
fi
timeout ${PPL_CAP:-170} eightbit eval ppl --model "$GGUF" --device cuda --data-dir "$DATA" --sq-checkpoint "$SQ" \
  --configs $PPL_CONFIGS --out "$OUT/ppl" --no-progress 2>&1 | grep -v -i warn | tail -30
timeout ${TASKS_CAP:-150} eightbit eval tasks --model "$GGUF" --device cuda --data-dir "$DATA" --sq-checkpoint "$SQ" \
  --configs $TASK_CONFIGS --tasks ${TASKS:-arc_easy,hellaswag,lambada} --limit ${TASK_LIMIT:-2376} --out "$OUT/tasks" --no-progress 2>&1 \
  | grep -v -i warn | tail -20
