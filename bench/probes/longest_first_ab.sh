# Longest-first decode attention at model and engine level, on vs off (one process each):
# decode B=64 C=1024 (equal lengths: what the argsort costs) twice, then bench.batching at
# max batch 64 (rows of unequal lengths: what the order gains). FP8 weights + FP8 KV.
# Usage on the H200, from the repository root: bash bench/probes/longest_first_ab.sh GIT_SHA
# (~9 min: each batching process compiles its 15 buckets in 160-185 s.) Results in $OUT.
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
JAXINFER_TEST_GPU=1 timeout 100 python3 -m pytest -q -m gpu -x tests/test_paged_attention.py \
  -k longest 2>&1 | tail -1
run_with() {  # run_with on|off CMD...
  if [ "$1" = on ]; then shift; env -u JAXINFER_LONGEST_FIRST "$@"
  else shift; JAXINFER_LONGEST_FIRST=0,0 "$@"; fi
}
for lf in on off on off; do
  run_with $lf timeout 100 python3 -m bench.cli decode --model llama-3-8b --dtype bfloat16 \
    --weights fp8 --kv-dtype fp8 --batch-sizes 64 --contexts 1024 --reps 5 --append \
    --out "$OUT/lf_decode.json" --git "$1" 2>&1 | grep "^llama" | tail -1
  echo "longest first: $lf"
done
for lf in on off; do
  S=$SECONDS
  run_with $lf timeout 280 python3 -m bench.batching --model llama-3-8b --weights fp8 \
    --kv-dtype fp8 --max-batch 64 --num-requests 384 --git "$1" \
    --out "$OUT/lf_batching_$lf.json" > "$OUT/lf_batching_$lf.log" 2>&1
  echo "batching longest first $lf: rc=$? $((SECONDS - S)) s"
  grep -v '^{' "$OUT/lf_batching_$lf.log" | tail -3
done
