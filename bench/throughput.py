"""`jaxinfer bench throughput`: offline output tokens/s of the engine on a fixed-length
workload (by default Llama-3-8B, FP8 weights + FP8 KV, 1000 requests of 1000 in / 1000 out,
512 rows and 2048 tokens a step: the headline offline figure).

Workload (seeded): num_requests prompts of exactly input_len random token ids, greedy,
ignore_eos, max_tokens = output_len, all queued at t=0 on one engine (prefix caching off; a
KV pool for max_num_seqs requests of input_len + output_len tokens at once, so nothing is
preempted); the engine admits a request whenever a row and its pages are free, prefill chunks
riding along with the running decode rows up to max_num_batched_tokens.

Every bucket is compiled first (engine.warmup, the greedy `plain` sampling variant only).
Timed: from queueing the first request until the last one's final token is on the host.
The row: output and total (prompt + output) tokens / wall, medians of the whole
`engine.step()` (`step_ms`) and of its host part (`host_ms_per_step`), compiles and
preemptions during the run (both should be 0), `step_kinds` (decode-only steps vs `mixed`
ones carrying a prefill chunk; needs async scheduling, the default) and `gpu_clocks`.
--time-limit-s bounds the whole run (load and warmup included): once spent, no further step
is dispatched and the row is written with `partial: true`.

--api adds a second row for the same workload through the public API, the way a user runs
it: `LLM(...)` (load and warm-up, timed as `construct_s`), then the first `generate()` call
on all the prompts (`output_tokens_per_s` from its wall time; `compiles` during it).
"""
from __future__ import annotations

import gc
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from bench import profile
from bench.batching import phase_medians, pool_pages
from bench.common import (dtype_name, engine_config, new_result, print_table, progress, save,
                          weights_name)
from bench.gpu_clocks import ClockMonitor
from jaxinfer import LLM
from jaxinfer.engine import Engine
from jaxinfer.kv_cache import kv_dtype_for
from jaxinfer.loading import load_model
from jaxinfer.request import SamplingParams
from jaxinfer.runner import CompileCounter

KEYS = ["model", "weights", "kv_dtype", "output_tokens_per_s", "total_tokens_per_s", "steps",
        "step_ms", "host_ms_per_step", "compiles", "preemptions", "partial"]


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


def drive(engine: Engine, workload, deadline: float | None,
          profile_window: tuple[int, int] | None = None) -> dict:
    """Queue the workload and step until it is done or the deadline passes. With
    profile_window (first step, count) those steps run under the profiler and the row gets
    their device time by kernel category (bench.profile's summary)."""
    c0, p0, s0 = CompileCounter.count(), engine.scheduler.num_preemptions, engine.num_steps
    g0 = engine.num_generated
    t0 = time.perf_counter()
    lengths = {engine.add_request({"prompt_token_ids": prompt},
                                  SamplingParams(temperature=0.0, max_tokens=n,
                                                 ignore_eos=True)): (len(prompt), n)
               for prompt, n in workload}
    queue_s = time.perf_counter() - t0
    host, step, phases, kinds = [], [], [], []
    trace_dir, stop_s = None, None
    finished = wrong_length = 0
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
            outs = engine.step(deltas=False)     # as LLM.generate steps
            host.append(engine.last_host_s)
            step.append(engine.last_step_s)
            phases.append(engine.last_phases)
            if waits_for is not None:   # async: this call's time is the in-flight step's
                kinds.append((*waits_for, engine.last_step_s))
            if trace_dir is not None and stop_s is None and \
                    engine.num_steps - s0 == sum(profile_window):
                stop_s = _stop_trace()
            for o in outs:     # finished ones only
                started.add(o.request_id)
                wrong_length += len(o.token_ids) != lengths[o.request_id][1]
            finished += len(outs)
            bar.update(len(outs))
    tokens = engine.num_generated - g0
    # Unfinished requests that produced a token count their prompts too (a partial run).
    started |= {r.request_id for r in engine.scheduler.requests.values()
                if r.num_output_tokens > r.num_pending}
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


def run(args) -> int:
    start = time.perf_counter()
    deadline = None if args.time_limit_s is None else start + args.time_limit_s
    base = engine_config(args)
    cfg, graphdef, params, tokenizer = load_model(args.model, base)
    workload = make_workload(args, cfg.vocab_size)
    ecfg = base.replace(
        num_pages=pool_pages(workload, args.max_num_seqs, base.page_size),
        max_model_len=args.input_len + args.output_len + 1, enable_prefix_caching=False)
    engine = Engine(cfg, ecfg, graphdef, params, tokenizer, model_name=args.model)
    load_s = time.perf_counter() - start
    # Greedy without logprobs or penalties: every step takes the `plain` sampling variant.
    warm = engine.warmup(progress=True, variants=("plain",))
    print(f"loaded in {load_s:.1f}s; compiled {warm['buckets']} buckets in "
          f"{warm['seconds']:.1f}s", file=sys.stderr, flush=True)
    result = new_result(args)
    row = {"path": "harness", "model": args.model, "weights": weights_name(ecfg),
           "kv_dtype": dtype_name(kv_dtype_for(ecfg)), "dtype": ecfg.dtype,
           **({"kv_scales": ecfg.kv_scales} if ecfg.kv_dtype == "fp8" else {}),
           **({"lm_head": ecfg.lm_head} if ecfg.lm_head != "bf16" else {}),
           "input_len": args.input_len, "output_len": args.output_len,
           "num_requests": args.num_requests}
    with ClockMonitor() as clocks:
        measured = drive(engine, workload, deadline, args.profile_steps)
    row.update(output_tokens_per_s=measured.pop("output_tokens_per_s"),
               total_tokens_per_s=measured.pop("total_tokens_per_s"),
               max_num_seqs=ecfg.max_num_seqs,
               max_num_batched_tokens=ecfg.max_num_batched_tokens,
               page_size=ecfg.page_size, num_pages=ecfg.total_pages,
               async_scheduling=ecfg.async_scheduling, seed=args.seed, **measured,
               load_s=round(load_s, 1), warmup_s=round(warm["seconds"], 1),
               gpu_clocks=clocks.summary())
    save(result, args.out, [row])
    if args.api:
        del engine, params        # its KV pool and weights: the API's engine needs the room
        gc.collect()
        save(result, args.out, [api_row(args, ecfg, workload, row)])
    print_table(result["rows"], KEYS)
    return 0


def api_row(args, ecfg, workload, harness: dict) -> dict:
    """The workload through LLM(...) and its first generate(): the user's path."""
    t0 = time.perf_counter()
    llm = LLM(args.model, engine_config=ecfg.replace(warmup=True))
    construct_s = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for _, n in workload]
    c0, t1 = CompileCounter.count(), time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=False)
    wall = time.perf_counter() - t1
    tokens = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p, _ in workload)
    return {**{k: harness[k] for k in ("model", "weights", "kv_dtype", "dtype", "input_len",
                                      "output_len", "num_requests", "max_num_seqs",
                                      "max_num_batched_tokens")},
            "path": "LLM.generate", "output_tokens_per_s": round(tokens / wall, 2),
            "total_tokens_per_s": round((tokens + prompt_tokens) / wall, 2),
            "wall_s": round(wall, 3), "output_tokens": tokens, "construct_s": round(construct_s, 1),
            "compiles": CompileCounter.count() - c0, "steps": llm.engine.num_steps,
            "wrong_length": sum(len(o.token_ids) != n for o, (_, n) in zip(outs, workload))}
