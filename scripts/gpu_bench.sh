#!/usr/bin/env bash
# Issue 6 engine benchmarks on one GPU, in one device call: eightbit W8A8+KV8 and bf16 vs HF transformers
# bf16 (eager; static cache + compile), bitsandbytes LLM.int8 and torchao int8-dynamic, on random weights
# of a real shape. Every system runs as its own process under a hard time cap; everything goes to $OUT
# (results.jsonl, <bench>.json/.png, summary.json, bench.log) and the summary with the goals prints last.
#
#   scripts/gpu_bench.sh [full|quick|engine|peers-long]
#     full        (default, ~9 min)  capacity; eightbit int8 and bf16: latency b1/16/64 + 256 requests
#                 (+ the first 64); HF bf16 compiled, HF bf16 eager, bnb, torchao eager on the first 64
#     quick       (~5 min)  capacity; eightbit int8/bf16 latency b1/64 + 64 requests; HF bf16 compiled
#     engine      (~6 min)  only eightbit int8 and bf16, bigger caps (iterate on the engine)
#     peers-long  (~9.5 min, a second call)  torchao int8 compiled (220 s warm-up), HF compiled at batch
#                 32 + its latency; merge with: eightbit bench summary --out A --inputs B/results.jsonl
#
# Env: OUT (default ./bench_out), MODEL (llama-3-8b), BUDGET (seconds for the whole script), PYTHON,
#      WHEELS_DIR (pip-installs its *.whl with --no-deps first: bitsandbytes, torchao).
set -u
MODE=${1:-full}
OUT=${OUT:-bench_out}
MODEL=${MODEL:-llama-3-8b}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench.log") 2>&1
START=$(date +%s)
case "$MODE" in
  full) BUDGET=${BUDGET:-540} ;;
  quick) BUDGET=${BUDGET:-300} ;;
  engine) BUDGET=${BUDGET:-360} ;;
  peers-long) BUDGET=${BUDGET:-560} ;;
  *) echo "unknown mode $MODE (full|quick|engine|peers-long)"; exit 2 ;;
esac
SUMMARY_RESERVE=20
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

echo "### gpu_bench.sh $MODE: model $MODEL, budget ${BUDGET}s, out $OUT, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
if [ -n "${WHEELS_DIR:-}" ] && ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps "$WHEELS_DIR"/*.whl || echo "### wheel install failed (peers needing them will report it)"
fi
if ! $PY -c "import eightbit.eval.bench_cli" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . || echo "### pip install -e . failed"
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" || true

SYSTEMS_RUN=()
# run NAME CAP ARGS...: one process with a soft cap (--time-cap) and a hard one (timeout), both within
# what is left of the budget; skipped when less than 30 s is left.
run() {
  local name=$1 cap=$2; shift 2
  local t0 left rc
  t0=$(date +%s)
  left=$(( BUDGET - (t0 - START) - SUMMARY_RESERVE ))
  if [ "$left" -lt 30 ]; then echo "### $name: skipped, ${left}s of the budget left"; return; fi
  [ "$cap" -gt "$left" ] && cap=$left
  SYSTEMS_RUN+=("$name")
  echo "### $name: soft cap ${cap}s ($(( t0 - START ))s into the run)"
  # the hard cap leaves 15 s past the soft one for a compile or a step in flight, minus what the budget lacks
  timeout -k 5 $(( cap + 15 )) $PY -m eightbit.eval.bench_cli run --system "$name" --model "$MODEL" \
    --out "$OUT" --time-cap "$(( cap - 3 ))" "$@"
  rc=$?
  echo "### $name: exit $rc after $(( $(date +%s) - t0 ))s$( [ $rc -ge 124 ] && echo ' (killed at the hard cap)')"
}

LIST="--num-requests 256 --input-len 100:1024 --output-len 100:1024 --seed 0"
LAT="--prompt-len 512 --new-tokens 128"
case "$MODE" in
  full)
    run eightbit-int8 150 --benches capacity,latency,throughput --batch-sizes 1,16,64 $LAT $LIST --prefix 64
    run eightbit-bf16 130 --benches latency,throughput --batch-sizes 1,16,64 $LAT $LIST --prefix 64
    run hf-bf16-compile 150 --benches throughput,latency --peer-requests 64 --hf-batch-sizes 64 \
      --throughput-cap 110 --batch-sizes 64,1 $LAT $LIST
    run hf-bf16 60 --benches latency,throughput --batch-sizes 1,64 --new-tokens 64 --prompt-len 512 \
      --peer-requests 64 --hf-batch-sizes 64 $LIST
    run hf-bnb-int8 45 --benches throughput,latency --peer-requests 64 --hf-batch-sizes 64 --throughput-cap 25 \
      --batch-sizes 64 --prompt-len 512 --new-tokens 32 $LIST
    run hf-torchao-int8 45 --benches throughput,latency --peer-requests 64 --hf-batch-sizes 64 --throughput-cap 25 \
      --batch-sizes 64 --prompt-len 512 --new-tokens 32 $LIST
    ;;
  quick)
    run eightbit-int8 100 --benches capacity,latency,throughput --batch-sizes 1,64 $LAT \
      --num-requests 64 --input-len 100:1024 --output-len 100:1024 --seed 0
    run eightbit-bf16 80 --benches latency,throughput --batch-sizes 1,64 $LAT \
      --num-requests 64 --input-len 100:1024 --output-len 100:1024 --seed 0
    run hf-bf16-compile 100 --benches throughput --peer-requests 64 --hf-batch-sizes 64 $LIST
    ;;
  engine)
    run eightbit-int8 190 --benches capacity,latency,throughput --batch-sizes 1,16,64 $LAT $LIST --prefix 64
    run eightbit-bf16 150 --benches latency,throughput --batch-sizes 1,16,64 $LAT $LIST --prefix 64
    ;;
  peers-long)
    run hf-torchao-int8-compile 330 --benches throughput,latency --peer-requests 64 --hf-batch-sizes 64 \
      --throughput-cap 290 --batch-sizes 64,1 --prompt-len 512 --new-tokens 64 $LIST
    run hf-bf16-compile 200 --benches throughput,latency --peer-requests 64 --hf-batch-sizes 32 \
      --throughput-cap 130 --batch-sizes 1,64 $LAT $LIST
    ;;
esac

EXPECT=$(IFS=,; echo "${SYSTEMS_RUN[*]}")
echo "### all systems done after $(( $(date +%s) - START ))s"
$PY -m eightbit.eval.bench_cli summary --out "$OUT" --expect "$EXPECT"
