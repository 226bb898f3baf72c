export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
SHA=$1
JAXINFER_TEST_GPU=1 timeout 150 python3 -m pytest -q -m gpu tests/test_swiglu_quant.py 2>&1 | tail -3
timeout 200 python3 -m bench.swiglu_quant --ms 512,2048 --passes 2 --git $SHA --out $OUT/swiglu_quant.json 2>&1 | grep -v '^{' | tail -40
i=0
for v in "" "fast_math=1" "fast_math=1,num_warps=16" ""; do
  i=$((i+1))
  JAXINFER_SWIGLU_TILES=$v timeout 100 python3 -m bench.cli profile --model llama-3-8b --dtype bfloat16 --weights fp8 --kv-dtype fp8 --batch-sizes 384 --contexts 1536 --reps 5 --kv-budget-gb 48 --out $OUT/profile_v$i.json --git $SHA > $OUT/profile_v$i.log 2>&1
  echo "== variant '$v' rc=$?"
  python3 -c "
import json,sys
d=json.load(open('$OUT/profile_v$i.json'))
for r in d['rows']:
  sw=[(t['name'],t['ms_per_step']) for t in r['top'] if t['name'].startswith('swiglu')]
  print(r['batch'], 'busy', r['busy_ms_per_step'], 'span', r['span_ms_per_step'], 'gemm', r['gemm_ms'], 'attn', r['attention_ms'], 'other', r['other_ms'], 'swiglu', sw)
" || tail -5 $OUT/profile_v$i.log
done
