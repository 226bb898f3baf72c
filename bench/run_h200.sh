#!/usr/bin/env bash
# The H200 run of the bench suites (issue 7 + issue 8's decode rows), one command:
#
#   OUT=/path/to/results GIT_SHA=<sha> bash bench/run_h200.sh
#
# Writes compile.json, decode.json (+ decode_roofline.png), fusion.json and one .log per
# suite into $OUT (default bench/results). Every suite has its own time limit, the whole
# run stays under ~9 minutes, and each suite rewrites its JSON after every row: a suite cut
# short by its limit still leaves what it measured. Expected duration: 7-9 minutes.
# A CPU smoke test of the script itself: MODEL=tiny BIG_MODEL=tiny DTYPE=float32 SEQS=4 \
#   BATCHES=1,2 CONTEXTS=16,32 OUT=/tmp/smoke bash bench/run_h200.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
GIT=${GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# Qwen2.5-32B's synthetic weights pass through bf16 on the device before FP8 quantization.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
mkdir -p "$OUT"
DEADLINE=535   # seconds for the whole script

suite() {  # suite NAME LIMIT_S ARGS...: run `bench.cli ARGS`, log to $OUT/NAME.log
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS)); shift 2
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then echo "== $name skipped: out of time"; return; fi
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$PY" -m bench.cli "$@" --git "$GIT" >"$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $((SECONDS - t0))s"
  grep -v '^{' "$OUT/$name.log" | tail -n 25
}

DTYPE=${DTYPE:-bfloat16}
LLAMA=(--model "${MODEL:-llama-3-8b}" --dtype "$DTYPE")
CTX1=${CONTEXTS:-512,1024,2048,8192}; CTX1=${CTX1%%,*}   # the batch-1 context of issue 8
suite compile 140 compile "${LLAMA[@]}" --max-num-seqs "${SEQS:-256}" \
  --max-num-batched-tokens 512 --out "$OUT/compile.json"
suite decode 150 decode "${LLAMA[@]}" --batch-sizes "${BATCHES:-1,8,64,256}" \
  --contexts "${CONTEXTS:-512,1024,2048,8192}" --reps 5 --out "$OUT/decode.json"
suite fusion 110 fusion "${LLAMA[@]}" --batch-sizes 1 --contexts "$CTX1" --out "$OUT/fusion.json"
suite decode_fp8 60 decode "${LLAMA[@]}" --weights fp8 --batch-sizes 1 --contexts "$CTX1" \
  --reps 5 --append --out "$OUT/decode.json"
suite decode_qwen 120 decode --model "${BIG_MODEL:-qwen2.5-32b}" --dtype "$DTYPE" --weights fp8 \
  --kv-dtype fp8 --batch-sizes 1 --contexts "$CTX1" --reps 5 --kv-budget-gb 8 --append \
  --out "$OUT/decode.json"
echo "== done in ${SECONDS}s; results in $OUT"
ls -l "$OUT"
