#!/usr/bin/env bash
# The H200 runs, in stages that each fit one device call (<= 9.5 minutes):
#
#   OUT=/path/to/results GIT_SHA=<sha> bash bench/run_h200.sh STAGE [STAGE ...]
#
# Pass GIT_SHA: the device tool's copy of the tree has run with a .git whose HEAD was an
# older commit than the files (this session's first calls recorded the session's first
# commit), so `git rev-parse` there can name the wrong code.
#
#   check     gpu-marked kernel tests (paged attention incl. the FP8->f16 path, FP8 matmul, the
#             fused SwiGLU / RMSNorm quantization kernels, the K/V write, the bf16 GEMV)   ~5 min
#   decode    decode roofline: Llama-3-8B bf16 scanned (B=1, the old default) then unrolled
#             (the GPU default) B 1/64/256 x C 512/1024, FP8 weights B=1, Qwen2.5-32B FP8+FP8
#             KV B=1                                                                            ~7 min
#   decode8   only the FP8 rows of `decode` (Llama-3-8B FP8 B=1, Qwen2.5-32B FP8 + FP8 KV),
#             appended to $OUT/decode.json (seed it with the committed file to extend it)  ~4 min
#   profile   where the decode step's time goes, kernel by kernel, B 1/64 (unrolled)         ~1 min
#   profile256  the same for the throughput run's decode step: FP8 weights + FP8 KV, B=256,
#             C=$PROFILE_CONTEXT (1536); $OUT/profile_b256_fp8.json                         ~2 min
#   kernels   paged attention, the issue's grid B 1/8/64/256 x S 512..32768: ours (FP8 read as
#             byte pairs, and widened to f16) vs bundled vs the XLA reference, both KV dtypes,
#             host clock and device time (6m17s at 8c0b89c, which compiled each program twice;
#             one compile since bf2d9f9, not timed)                                        ~6 min
#   attnprobe FP8/bf16 paged decode at B=256 S=2048 under Nsight Compute (ncu_*.txt), the
#             FP8 block-size sweep (--tune, B 64/256 x S 2048), then kernels at B 64/256 x
#             S 2048/8192 (ours, ours widened to f16, bundled)                              ~5 min
#   mixed     one mixed step's attention (255 decode rows + a 1793-token prefill chunk), bf16
#             and FP8 KV: the ragged kernel over every row vs decode + ragged split, and the
#             prefill row alone under other ragged blocks (bench.kernels PREFILL_VARIANTS)  ~1 min
#   fp8tune   FP8 GEMV (M=1) tile variants on the four Llama-3-8B projection shapes          ~2 min
#   swiglu    the fused SiLU * up + e4m3 kernel's block variants vs XLA's unfused route, M
#             384/488/2048, F 14336, two passes; $OUT/swiglu_quant.json                       ~2 min
#   fp8       FP8 matmul: ours vs XLA bf16 vs XLA dequant, M 1..2048, four shapes, host clock
#             and device time; $FP8_SHAPES (KxN,...) picks shapes: with device time two shapes
#             took 6 min at 380263e (programs compiled twice), so run the four in two calls  ~7 min
#   compile   every bucket cold / warm, kernels per layer                                    ~2 min
#   fusion    fused vs op-by-op (eager) vs command buffers off, B=1                          ~4 min
#   batching  continuous vs static batching, 1,536 requests ($NUM_REQUESTS), max batch 16 and 32
#             ($MAX_BATCH; 64,256 took a second call of ~5 min)                              ~8 min
#   serving   gRPC request-rate sweep, short-answer + chat workloads                         ~8 min
#   cmdbuf    decode B 1/64 under each XLA command-buffer update mode (one process each),
#             with XLA's per-call "Updated N commands" log lines; rows in $OUT/cmdbuf.json     ~4 min
#   splits    decode B=1 C=512, bf16 then FP8 weights, with the attention split floor at 512
#             (default) and at 64 tokens ($SPLIT_FLOORS), one process each; rows in
#             $OUT/splits.json                                                               ~3 min
#   xlaflags  decode B=1, bf16 then FP8 weights, under each XLA flag set of $FLAG_SETS (e.g.
#             PDL off, exhaustive GEMM tiling search), one process each; rows in
#             $OUT/xla_flags.json                                                            ~1 min/set
#   engine1   one request through the real engine (async scheduling): 512 in / 256 out,
#             bf16 then FP8 weights ($ENGINE1_WEIGHTS); its median step is the B=1 decode
#             step serving sees                                                              ~4 min
#   outputs   persistent step outputs (runner.PERSISTENT_OUTPUTS): the runner's output-buffer
#             tests on the GPU backend (aliasing, the select folded away), then on vs off in
#             one process (bench.probes.outputs_ab), Llama-3-8B FP8 then bf16 weights, B=1;
#             $OUT/outputs_ab_<weights>.json                                                  ~2 min
#   throughput  offline throughput, Llama-3-8B FP8 weights + FP8 KV, $NUM_REQUESTS (1000)
#             requests of 1000 in / 1000 out, max $THR_SEQS (512) seqs and $THR_TOKENS
#             (2048) tokens per step; a partial row if
#             the 300 s limit comes first; THR_PROFILE=FIRST:COUNT profiles those steps;
#             THR_KV_SCALES=token runs per-token FP8 KV scales (default: static),
#             THR_LM_HEAD=int8 the int8 LM head (default: bf16)                              ~5 min
#
# Each suite writes its JSON (and a .log) into $OUT and rewrites the JSON after every row, so
# a suite cut short by its limit keeps what it measured. Memory is not preallocated: suites
# that start a child process (compile warm start, fusion's command-buffers-off run) need room.
# A CPU smoke test of the script: MODEL=tiny BIG_MODEL=tiny DTYPE=float32 SEQS=4 \
#   BATCHES=1,2 CONTEXTS=16,32 OUT=/tmp/smoke bash bench/run_h200.sh compile decode fusion
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
GIT=${GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# Not preallocated, but allowed 90% of the card: with per-layer weight buffers the allocator's
# free space is fragmented and the 75% default ran out on the decode suite's 32 GB KV pool.
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
mkdir -p "$OUT"
DEADLINE=${DEADLINE:-570}   # seconds for the whole invocation

run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, print the tail
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS)); shift 2
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then echo "== $name skipped: out of time"; return; fi
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name rc=$? after $((SECONDS - t0))s"
  grep -v '^{' "$OUT/$name.log" | tail -n 12
}
bench() { local name=$1 limit=$2; shift 2; run "$name" "$limit" "$PY" -m bench.cli "$@" --git "$GIT"; }

DTYPE=${DTYPE:-bfloat16}
LLAMA=(--model "${MODEL:-llama-3-8b}" --dtype "$DTYPE")
BATCHES=${BATCHES:-1,64,256}
CONTEXTS=${CONTEXTS:-512,1024}
CTX1=${CONTEXTS%%,*}

decode_fp8_rows() {  # the FP8 rows of `decode`, appended to $OUT/decode.json
  bench decode_fp8 90 decode "${LLAMA[@]}" --weights fp8 --batch-sizes 1 \
    --contexts "$CTX1" --reps 5 --append --out "$OUT/decode.json"
  bench decode_qwen 180 decode --model "${BIG_MODEL:-qwen2.5-32b}" --dtype "$DTYPE" \
    --weights fp8 --kv-dtype fp8 --batch-sizes 1 --contexts "$CTX1" \
    --reps 5 --kv-budget-gb 8 --append --out "$OUT/decode.json"
}

for stage in "$@"; do
  case $stage in
    check)
      JAXINFER_TEST_GPU=1 run check 400 "$PY" -m pytest -q -m gpu -x \
        tests/test_paged_attention.py tests/test_ragged_paged_attention.py tests/test_fp8_matmul.py \
        tests/test_swiglu_quant.py tests/test_norm_quant.py tests/test_kv_write.py tests/test_gemv.py ;;
    decode8)
      decode_fp8_rows ;;
    decode)
      bench decode_scan 90 decode "${LLAMA[@]}" --layer-loop scan --batch-sizes "${BATCHES%%,*}" \
        --contexts "$CTX1" --reps 5 --out "$OUT/decode.json"
      bench decode 130 decode "${LLAMA[@]}" --batch-sizes "$BATCHES" \
        --contexts "$CONTEXTS" --reps 5 --append --out "$OUT/decode.json"
      decode_fp8_rows ;;
    profile)
      bench profile 120 profile "${LLAMA[@]}" --batch-sizes 1,64 --contexts "$CTX1" --reps 5 \
        --out "$OUT/profile.json" ;;
    profile256)
      # the throughput run's decode step: FP8 weights + FP8 KV, 256 rows at ~1500 tokens
      bench profile256 150 profile "${LLAMA[@]}" --weights fp8 --kv-dtype fp8 --batch-sizes 256 \
        --contexts "${PROFILE_CONTEXT:-1536}" --reps 5 --kv-budget-gb 40 \
        --out "$OUT/profile_b256_fp8.json" ;;
    kernels)
      run kernels 420 "$PY" -m bench.kernels --git "$GIT" --out "$OUT/paged_attention.json" ;;
    attnprobe)
      for kv in fp8 bf16; do
        run "ncu_$kv" 90 ncu --clock-control none -k regex:paged_decode --launch-skip 2 \
          --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section WarpStateStats --section ComputeWorkloadAnalysis \
          --section MemoryWorkloadAnalysis "$PY" -m bench.kernel_probe 256 2048 "$kv"
        mv "$OUT/ncu_$kv.log" "$OUT/ncu_$kv.txt"
      done
      run attn_tune 150 "$PY" -m bench.kernels --tune --tune-shapes 64x2048,256x2048 \
        --tune-kv fp8 --tune-prefetch 0,1 --git "$GIT"
      run kernels 200 "$PY" -m bench.kernels --batches 64,256 --contexts 2048,8192 \
        --impls jaxinfer,jaxinfer_f16widen,bundled --git "$GIT" \
        --out "$OUT/paged_attention.json" ;;
    swiglu)
      run swiglu 180 "$PY" -m bench.swiglu_quant --git "$GIT" --out "$OUT/swiglu_quant.json" ;;
    mixed)
      run mixed 200 "$PY" -m bench.kernels --mixed --batches 64 --contexts 2048 \
        --impls jaxinfer --no-write-kv --git "$GIT" --out "$OUT/mixed_attention.json" ;;
    fp8tune)
      run fp8tune 200 "$PY" -m bench.fp8_matmul --tune-only --git "$GIT" \
        --out "$OUT/fp8_tune.json" ;;
    fp8)
      run fp8 450 "$PY" -m bench.fp8_matmul --git "$GIT" --ms "${FP8_MS:-1,8,16,32,64,128,2048}" \
        --shapes "${FP8_SHAPES:-4096x6144,4096x4096,4096x28672,14336x4096}" \
        --out "$OUT/fp8_matmul.json" ;;
    compile)
      bench compile 200 compile "${LLAMA[@]}" --max-num-seqs "${SEQS:-64}" \
        --max-num-batched-tokens 512 --out "$OUT/compile.json" ;;
    fusion)
      bench fusion 220 fusion "${LLAMA[@]}" --batch-sizes 1 --contexts "$CTX1" --reps 3 \
        --out "$OUT/fusion.json" ;;
    batching)
      run batching 560 "$PY" -m bench.batching --model "${MODEL:-llama-3-8b}" \
        --max-batch "${MAX_BATCH:-16,32}" --num-requests "${NUM_REQUESTS:-1536}" --git "$GIT" \
        --out "$OUT/batching.json" ;;
    serving)
      run serving 540 "$PY" -m bench.serving --model "${MODEL:-llama-3-8b}" --max-num-seqs 64 \
        --max-num-batched-tokens 1024 --max-model-len 2048 --rates "${RATES:-4,8,16,24,32,48,64}" \
        --chat-rates "${CHAT_RATES:-2,4,8,16}" --duration "${DURATION:-15}" --git "$GIT" \
        --out "$OUT/serving.json" ;;
    throughput)
      # The suite stops dispatching at --time-limit-s (counted from its start, load and
      # warmup included) and writes a partial row, before `timeout` would kill it.
      lim=$((DEADLINE - SECONDS)); (( lim > ${THR_LIMIT:-300} )) && lim=${THR_LIMIT:-300}
      run throughput "$lim" "$PY" -m bench.throughput "${LLAMA[@]}" --weights fp8 --kv-dtype fp8 \
        --input-len 1000 --output-len 1000 --num-requests "${NUM_REQUESTS:-1000}" \
        --max-num-seqs "${THR_SEQS:-512}" --max-num-batched-tokens "${THR_TOKENS:-2048}" \
        --time-limit-s $((lim - lim / 10)) --git "$GIT" \
        ${THR_KV_SCALES:+--kv-scales "$THR_KV_SCALES"} ${THR_LM_HEAD:+--lm-head "$THR_LM_HEAD"} \
        ${THR_PROFILE:+--profile-steps "$THR_PROFILE"} --out "$OUT/throughput.json" ;;
    cmdbuf)
      for mode in ${CMDBUF_MODES:-ALWAYS_UPDATE SKIP_TEMP SKIP_PROFILED}; do
        ( export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_command_buffer_update_mode=$mode" \
            TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_executor=1,command_buffer_thunk=1
          bench "cmdbuf_$mode" 110 decode "${LLAMA[@]}" --batch-sizes 1,64 --contexts "$CTX1" \
            --reps 5 --append --out "$OUT/cmdbuf.json" )
        grep -a -i "updated .* commands" "$OUT/cmdbuf_$mode.log" | tail -n 2 | cut -c1-300
      done
      rm -f "$OUT/cmdbuf_roofline.png" ;;
    splits)
      for w in bf16 fp8; do
        for floor in ${SPLIT_FLOORS:-512 64}; do
          JAXINFER_MIN_SPLIT_TOKENS=$floor bench "splits_${w}_$floor" 60 decode "${LLAMA[@]}" \
            --weights "$w" --batch-sizes 1 --contexts "$CTX1" --reps 5 --append \
            --out "$OUT/splits.json"
        done
      done
      rm -f "$OUT/splits_roofline.png" ;;
    xlaflags)
      # decode B=1 C=$CTX1 (weights $FLAG_WEIGHTS) under each XLA flag set of $FLAG_SETS
      # (';'-separated, '-' = none), one process each; every run records its XLA_FLAGS.
      # Importing jaxinfer adds --xla_gpu_enable_pdl=true unless a set names that flag, so
      # '-' runs with PDL on and the default pair compares it with PDL off.
      IFS=';' read -ra sets <<< "${FLAG_SETS:--;--xla_gpu_enable_pdl=false}"
      for w in ${FLAG_WEIGHTS:-bf16 fp8}; do
        i=0
        for fs in "${sets[@]}"; do
          [[ $fs == - ]] && fs=
          ( export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$fs"
            bench "xlaflags_${w}_$i" "${FLAG_LIMIT:-100}" decode "${LLAMA[@]}" --weights "$w" \
              --batch-sizes 1 --contexts "$CTX1" --reps 5 --append --out "$OUT/xla_flags.json" )
          i=$((i + 1))
        done
      done
      rm -f "$OUT/xla_flags_roofline.png"
      "$PY" - "$OUT/xla_flags.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(f'{r["weights"]:5} {r["step_ms"]:8.3f} ms synced {r["step_ms_device"]:8.3f} ms b2b '
          f'{r["tokens_per_s"]:8.1f} tok/s  {d["runs"][r["run"]]["xla_flags"] or "(default)"}')
PYEOF
      ;;
    engine1)
      for w in ${ENGINE1_WEIGHTS:-bf16 fp8}; do
        run "engine1_$w" 170 "$PY" -m bench.throughput "${LLAMA[@]}" --weights "$w" \
          --kv-dtype bf16 --input-len 512 --output-len 256 --num-requests 1 --max-num-seqs 1 \
          --git "$GIT" --append --out "$OUT/engine_b1.json"
      done ;;
    outputs)
      JAXINFER_TEST_GPU=1 run outputs_tests 120 "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_runner_pack.py -k "persistent or fresh_outputs"
      for w in fp8 bf16; do
        run "outputs_ab_$w" 120 "$PY" -m bench.probes.outputs_ab "${LLAMA[@]}" --weights "$w" \
          --git "$GIT" --out "$OUT/outputs_ab_$w.json"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s; results in $OUT"
ls -l "$OUT"
