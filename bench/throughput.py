"""Offline throughput: output tokens/s of the engine on a fixed-length workload.

By default Llama-3-8B with FP8 weights and FP8 KV at 1000 input / 1000 output tokens.

    python -m bench.throughput --model llama-3-8b --num-requests 1000 --time-limit-s 270 \
        --out bench/results/throughput.json                   # H200: FP8 weights + FP8 KV
    python -m bench.throughput --model tiny --input-len 12 --output-len 6 --num-requests 5 \
        --max-num-seqs 2 --max-num-batched-tokens 16 --out /tmp/t.json

Workload (seeded): num_requests prompts of exactly input_len random token ids in [3, vocab),
greedy, ignore_eos, max_tokens = output_len, so every request emits exactly output_len tokens.
All of them are queued at t=0 on one engine (prefix caching off; a KV pool sized like
bench/batching.py's, for max_num_seqs requests of input_len + output_len tokens at once, so
nothing is preempted); the engine admits a request whenever a row and its pages are free,
prefill chunks riding along with the running decode rows up to max_num_batched_tokens.

Every bucket is compiled (engine.warmup, the `plain` sampling variant only: greedy) before
timing. Timed: from queueing the first
request until the last request's final token is back on the host. The row:
`output_tokens_per_s` = output tokens / wall, `total_tokens_per_s` = (prompt + output tokens)
/ wall, medians of the whole `engine.step()` (`step_ms`) and of its host part
(`host_ms_per_step`, engine.last_host_s), compiles and preemptions during the timed run (both
should be 0). `step_kinds` splits the steps into `decode` (every row one token) and `mixed`
(a prefill chunk rides along): count, median tokens and ms, total seconds. It needs async
scheduling (the default), where an engine.step() call's time is charged to the step in
flight it waited for; with --no-async-scheduling it stays empty. `gpu_clocks`: the SM clock
and board power through the timed run (bench/gpu_clocks.py; None off the GPU).
`--profile-steps FIRST:COUNT` runs those steps under the profiler and adds their device time
by kernel category (`profile`, bench.profile's summary) to the row; the trace is read after
the timed run, but stopping the profiler (`stop_trace_s`) and its overhead on those steps
fall inside it.

`--simulate` replays the workload through the scheduler alone (bench.batching.replay: no
model, no device, seconds on a CPU) and prices each step with a step-time model of the
Llama-3-8B FP8 + FP8 KV engine on the H200 fitted to measured runs (MODEL_POINTS below): a
planning tool for the engine's knobs (--max-num-seqs, --max-num-batched-tokens), whose
`predicted_*` numbers are not measurements. Its step counts are the run's (2,308 against the
H200's 2,309); its time is optimistic by 9% (56.3 s predicted, 61.7 s measured at 921e01b;
59.0 against 64.1 at 4fa4f66 and 58.7 against 63.7 at 79f568b with the fits before). It put
256 rows per step 4.0% below 512; the tenth session measured 3.4%. It put 640 rows with
8,192 tokens a step 1.7% above 512 / 2,048; the thirty-sixth session measured 1.8% below (one
machine, one run each): its fits hold no step of more than 2,048 tokens.

--time-limit-s bounds the whole run from the start of main() (model load and warmup
included): once it is spent no further step is dispatched and the row is written with
`partial: true`, the tokens received so far (the step still in flight is not counted) and
`finished_requests`, so a device call with a hard time limit still leaves a result.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench import profile
from bench.batching import (add_engine_flags, engine_config, phase_medians, replay,
                            step_counts)
from bench.common import dtype_name, git_sha, new_result, progress, save, weights_name
from bench.gpu_clocks import ClockMonitor
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.request import SamplingParams
from jaxinfer.runner import CompileCounter, kv_dtype_for


# --simulate's step-time model (ms) of Llama-3-8B with FP8 weights + FP8 KV on the H200:
# a piecewise-linear function of the step's tokens (the GEMMs and the per-token kernels;
# extended past the last point by the last segment's slope) plus ATTENTION_MS_PER_ROW_TOKEN
# per context token of each decode row (prefill chunks' attention is left out). Fitted to
# the code with one KV array per layer (921e01b, nineteenth session):
#   (8, 2.6)      the batch-1 decode step (rows padded to 8): 2.80 ms (fp8_decode.json,
#                 79757c5) less ~0.2 ms of attention at context 512 (profile_b1_fp8.json)
#   (256, 4.96)   profile_b256_fp8.json (ee2f885): GEMMs 3.52 + all but attention 1.44 ms
#   (384, 6.72)   profile_b384_fp8.json (921e01b): busy 16.75 ms less attention 10.03
#   (488, 8.5)    throughput.json (921e01b): decode-only steps, median 488 rows, 20.96 ms,
#                 less their attention at ~1,500 tokens of context (12.45 ms by the rate below)
#   (2048, 28.6)  its steps with a prefill chunk, median 2,048 tokens, 41.03 ms, less the same
# and attention from profile_b384_fp8.json: 10.03 ms over 384 rows x 1,536 tokens (10.64
# with the stacked pool at 4fa4f66; 7.48 ms over 256 rows before the masked loads,
# profile_b256_fp8.json).
MODEL_POINTS = ((8, 2.6), (256, 4.96), (384, 6.72), (488, 8.5), (2048, 28.6))
ATTENTION_MS_PER_ROW_TOKEN = 10.0307 / (384 * 1536)


def model_step_ms(tokens: int, decode_context: int) -> float:
    """The step-time model above: a step of `tokens` tokens whose decode rows hold
    `decode_context` context tokens in all."""
    xs, ys = zip(*MODEL_POINTS)
    if tokens <= xs[-1]:
        base = float(np.interp(tokens, xs, ys))
    else:
        base = ys[-1] + (tokens - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return base + ATTENTION_MS_PER_ROW_TOKEN * decode_context


def simulate(args) -> dict:
    """The workload replayed through the scheduler (bench.batching.replay) and priced by
    model_step_ms: the steps' makeup (counted) and the predicted time (modelled)."""
    workload = make_workload(args, 1000)   # lengths do not depend on the vocabulary
    cfg = engine_config(args, workload, args.max_num_seqs, "float32")
    steps = replay(cfg, workload)
    ms = [model_step_ms(rows + chunk, ctx) for rows, ctx, chunk in steps]
    predicted_s = sum(ms) / 1e3
    out_tokens = sum(n for _, n in workload)
    return {"simulated": True, "input_len": args.input_len, "output_len": args.output_len,
            "num_requests": args.num_requests, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "page_size": args.page_size, "num_pages": cfg.total_pages, **step_counts(steps),
            "predicted_s": round(predicted_s, 3),
            "predicted_output_tokens_per_s": round(out_tokens / predicted_s, 1),
            "predicted_attention_share": round(
                sum(ATTENTION_MS_PER_ROW_TOKEN * ctx for _, ctx, _ in steps) / sum(ms), 3)}


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)]: num_requests prompts of input_len ids, seeded."""
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, vocab_size, (args.num_requests, args.input_len))
    return [(p.tolist(), args.output_len) for p in prompts]


def step_kinds(kinds: list[tuple[str, int, float]]) -> dict:
    """Per kind of step (`decode`: every row one token; `mixed`: a prefill chunk rides
    along): how many, median tokens and ms, and the seconds they took in all."""
    out = {}
    for kind in ("decode", "mixed"):
        sel = [(n, s) for k, n, s in kinds if k == kind]
        if sel:
            out[kind] = {"steps": len(sel),
                         "median_tokens": int(statistics.median(n for n, _ in sel)),
                         "median_ms": round(statistics.median(s for _, s in sel) * 1e3, 3),
                         "total_s": round(sum(s for _, s in sel), 3)}
    return out


def _inflight_kind(engine: Engine) -> tuple[str, int] | None:
    """(kind, tokens) of the step in flight: the one the next engine.step() waits for."""
    out = engine.inflight
    if out is None:
        return None
    return ("decode" if out.num_tokens == out.num_rows else "mixed"), out.num_tokens


def run(engine: Engine, workload, deadline: float | None,
        profile_window: tuple[int, int] | None = None) -> dict:
    """Queue the workload and step until it is done or the deadline passes. With
    profile_window (first step, count) those steps run under the profiler and the row gets
    their device time by kernel category (bench.profile's summary)."""
    c0, p0, s0 = CompileCounter.count(), engine.scheduler.num_preemptions, engine.num_steps
    t0 = time.perf_counter()
    lengths = {engine.add_request({"prompt_token_ids": prompt},
                                  SamplingParams(temperature=0.0, max_tokens=n,
                                                 ignore_eos=True)): (len(prompt), n)
               for prompt, n in workload}
    queue_s = time.perf_counter() - t0
    host, step, phases, kinds = [], [], [], []
    trace_dir, stop_s = None, None
    tokens = finished = wrong_length = 0
    started: set[str] = set()
    partial = False
    with progress(None, "requests", total=len(workload), unit="req") as bar:
        while engine.has_unfinished_requests():
            if deadline is not None and time.perf_counter() >= deadline:
                partial = True
                break
            n = engine.num_steps - s0
            if profile_window and n == profile_window[0] and trace_dir is None:
                trace_dir = tempfile.mkdtemp(prefix="thr_profile_")
                profile.start_trace(trace_dir)
            waits_for = _inflight_kind(engine)
            outs = engine.step()
            host.append(engine.last_host_s)
            step.append(engine.last_step_s)
            phases.append(engine.last_phases)
            if waits_for is not None:   # async: this call's time is the in-flight step's
                kinds.append((*waits_for, engine.last_step_s))
            if trace_dir is not None and stop_s is None and \
                    engine.num_steps - s0 == sum(profile_window):
                stop_s = _stop_trace()
            done = 0
            for o in outs:
                tokens += len(o.new_token_ids)
                started.add(o.request_id)
                if o.finished:
                    done += 1
                    wrong_length += len(o.token_ids) != lengths[o.request_id][1]
            finished += done
            bar.update(done)
    wall = time.perf_counter() - t0
    profiled = None
    if trace_dir is not None:   # read outside the timed region
        profiled_steps = min(profile_window[1], engine.num_steps - s0 - profile_window[0])
        if stop_s is None:      # the run ended inside the window
            stop_s = _stop_trace()
        profiled = _summarize_trace(trace_dir, profile_window[0], max(1, profiled_steps),
                                    stop_s)
    prompt_tokens = sum(lengths[r][0] for r in started)   # prompts that produced a token
    return {"wall_s": round(wall, 3), "queue_s": round(queue_s, 3),
            "output_tokens_per_s": round(tokens / wall, 2),
            "total_tokens_per_s": round((prompt_tokens + tokens) / wall, 2),
            "output_tokens": tokens, "finished_requests": finished,
            "wrong_length": wrong_length, "partial": partial,
            "steps": engine.num_steps - s0,
            "step_ms": round(statistics.median(step) * 1e3, 3) if step else None,
            "host_ms_per_step": round(statistics.median(host) * 1e3, 3) if host else None,
            "host_share": round(sum(host) / sum(step), 4) if step else None,
            "schedule_share": round(sum(p.get("schedule", 0.0) for p in phases)
                                    / sum(step), 4) if step else None,
            "host_phases_ms": phase_medians(phases),
            "step_kinds": step_kinds(kinds),
            **({"profile": profiled} if profiled is not None else {}),
            "padding_fraction": round(engine.buckets.padding_fraction, 4),
            "compiles": CompileCounter.count() - c0,
            "preemptions": engine.scheduler.num_preemptions - p0}


def _stop_trace() -> float:
    """Stop the profiler; returns the seconds that took (inside the timed run)."""
    t = time.perf_counter()
    jax.profiler.stop_trace()
    return time.perf_counter() - t


def _summarize_trace(trace_dir: str, first: int, steps: int, stop_s: float) -> dict:
    """The trace's device events summarized over `steps` steps."""
    try:
        events = profile.device_events(profile.read_events(trace_dir))
        return {"first_step": first, "steps": steps, "stop_trace_s": round(stop_s, 3),
                **profile.summarize(events, steps, top=20)}
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def _window(text: str) -> tuple[int, int]:
    first, _, count = text.partition(":")
    try:
        window = int(first), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:COUNT (e.g. 2000:40), got {text!r}")
    if window[0] < 0 or window[1] < 1:
        raise argparse.ArgumentTypeError(f"need FIRST >= 0 and COUNT >= 1, got {text!r}")
    return window


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, model="llama-3-8b", weights="fp8", kv_dtype="fp8")
    ap.add_argument("--input-len", type=int, default=1000, help="prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=1000, help="output tokens per request")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=512,
                    help="rows per step (512: 14,806 output tok/s on the H200 against 14,299 "
                         "at 256, bench/README.md tenth session)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="stop dispatching steps this many seconds after start (load and "
                         "warmup included) and write the partial row")
    ap.add_argument("--profile-steps", type=_window, default=None, metavar="FIRST:COUNT",
                    help="run steps FIRST..FIRST+COUNT-1 of the timed run under the profiler "
                         "and add their device time by kernel category to the row (the "
                         "profiler slows those steps, and stopping it takes seconds inside "
                         "the timed run: not for headline numbers)")
    ap.add_argument("--git", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", default=None, help="results JSON (e.g. "
                                                "bench/results/throughput.json); needed "
                                                "unless --simulate")
    ap.add_argument("--simulate", action="store_true",
                    help="replay the workload through the scheduler alone and print the "
                         "steps and a modelled time (module doc); loads no model")
    ap.add_argument("--append", action="store_true",
                    help="add this run's row to an existing --out file (the row carries its "
                         "own command) instead of replacing the file")
    args = ap.parse_args(argv)
    if args.out is None and not args.simulate:
        ap.error("--out is required (unless --simulate)")
    for name in ("input_len", "output_len", "num_requests", "max_num_seqs",
                 "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    start = time.perf_counter()
    args = parse_args(argv)
    if args.simulate:
        row = simulate(args)
        print(json.dumps(row), flush=True)
        return {"rows": [row]}
    deadline = None if args.time_limit_s is None else start + args.time_limit_s
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    cfg, graphdef, params, tokenizer = load_model(
        args.model, EngineConfig(dtype=dtype, weights=args.weights, lm_head=args.lm_head))
    workload = make_workload(args, cfg.vocab_size)
    ecfg = engine_config(args, workload, args.max_num_seqs, dtype)
    engine = Engine(cfg, ecfg, graphdef, params, tokenizer, model_name=args.model)
    load_s = time.perf_counter() - start
    print(f"loaded in {load_s:.1f}s; compiling {len(engine.buckets.all_buckets())} buckets",
          file=sys.stderr, flush=True)
    # Greedy without logprobs or penalties: every step takes the `plain` sampling variant,
    # so only that one is compiled (compiles during the run are recorded: they must be 0).
    warm = engine.warmup(progress=True, variants=("plain",))
    print(f"loaded in {load_s:.1f}s; compiled {warm['buckets']} buckets in "
          f"{warm['seconds']:.1f}s", file=sys.stderr, flush=True)
    command = "python -m bench.throughput " + " ".join(argv if argv is not None
                                                       else sys.argv[1:])
    result = new_result("throughput", args.git, command=command)
    if args.append and Path(args.out).exists():
        result = json.loads(Path(args.out).read_text())
    row = {"model": args.model, "weights": weights_name(ecfg),
           "kv_dtype": dtype_name(kv_dtype_for(ecfg)), "dtype": dtype,
           **({"kv_scales": ecfg.kv_scales} if ecfg.kv_dtype == "fp8" else {}),
           **({"lm_head": ecfg.lm_head} if ecfg.lm_head != "bf16" else {}),
           "input_len": args.input_len, "output_len": args.output_len,
           "num_requests": args.num_requests}
    with ClockMonitor() as clocks:
        measured = run(engine, workload, deadline, args.profile_steps)
    row.update(output_tokens_per_s=measured.pop("output_tokens_per_s"),
               total_tokens_per_s=measured.pop("total_tokens_per_s"),
               max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               page_size=args.page_size, num_pages=ecfg.total_pages,
               async_scheduling=ecfg.async_scheduling, seed=args.seed, **measured,
               load_s=round(load_s, 1), warmup_s=round(warm["seconds"], 1),
               gpu_clocks=clocks.summary(), command=command, git=git_sha(args.git))
    save(result, args.out, [row])
    return result


if __name__ == "__main__":
    main()
