"""`jaxinfer bench batching`: continuous vs static batching on one engine, output tokens/s on
a workload of mixed lengths.

Workload (seeded): prompt and output lengths log-normal around the given medians, clipped to
[LO, HI]; random prompt tokens; greedy, ignore_eos, so every request emits exactly its output
length. Both modes run the same requests on the same engine (prefix caching off, so the
second mode cannot reuse the first one's pages; a KV pool for the max_batch longest requests
at once, so nothing is preempted):
  continuous  every request queued at t=0; the engine admits one as soon as a row frees up
  static      groups of max_batch requests in order; a group starts when the previous one has
              finished, so rows freed by short answers idle until the longest ends
Every bucket is compiled (engine.warmup) before timing; compiles during the timed runs are
recorded (should be 0). Per mode: output tokens / wall, medians of the whole step
(engine.last_step_s) and of its host part (engine.last_host_s), the host's and the
scheduler's shares of all step time, and each host phase's median (Engine.last_phases).
"""
from __future__ import annotations

import gc
import statistics
import sys
import time

import numpy as np

from bench.common import engine_config, new_result, print_table, save
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.request import SamplingParams
from jaxinfer.runner import CompileCounter

KEYS = ["mode", "max_batch", "output_tokens_per_s", "steps", "step_ms", "host_ms_per_step",
        "host_share", "compiles_during_run", "preemptions"]


def lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)], seeded."""
    rng = np.random.default_rng(args.seed)
    plens = lognormal_lengths(rng, args.num_requests, args.prompt_median, args.sigma,
                              *args.prompt_len)
    olens = lognormal_lengths(rng, args.num_requests, args.output_median, args.sigma,
                              *args.output_len)
    return [(rng.integers(3, vocab_size, p).tolist(), int(o)) for p, o in zip(plens, olens)]


def pool_pages(workload, max_batch: int, page_size: int) -> int:
    """Pages for the max_batch longest requests at once (+ the reserved page 0)."""
    pages = sorted((-(-(len(p) + o) // page_size) for p, o in workload), reverse=True)
    return sum(pages[:max_batch]) + 1


def exact_length(n: int) -> SamplingParams:
    """Greedy, EOS ignored: the request emits exactly n tokens."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def mode_groups(workload, mode: str, max_batch: int) -> list:
    return [workload] if mode == "continuous" else [
        workload[i:i + max_batch] for i in range(0, len(workload), max_batch)]


def drive(engine: Engine, requests) -> dict:
    """Queue `requests`, step until all are done; per-step host and total seconds."""
    for prompt, n in requests:
        engine.add_request({"prompt_token_ids": prompt}, exact_length(n))
    host, step, phases, tokens = [], [], [], 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
        host.append(engine.last_host_s)
        step.append(engine.last_step_s)
        phases.append(engine.last_phases)
    return {"host": host, "step": step, "phases": phases, "tokens": tokens}


def phase_medians(phases: list[dict]) -> dict:
    """Median milliseconds of each of Engine.last_phases' parts over the steps."""
    return {k: round(statistics.median(p[k] for p in phases) * 1e3, 3)
            for k in (phases[0] if phases else {})}


def measure(engine: Engine, workload, mode: str, max_batch: int) -> dict:
    c0, p0 = CompileCounter.count(), engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    runs = [drive(engine, g) for g in mode_groups(workload, mode, max_batch)]
    wall = time.perf_counter() - t0
    host = [h for r in runs for h in r["host"]]
    step = [s for r in runs for s in r["step"]]
    phases = [p for r in runs for p in r["phases"]]
    tokens = sum(r["tokens"] for r in runs)
    return {"mode": mode, "max_batch": max_batch, "requests": len(workload),
            "output_tokens": tokens, "steps": len(step), "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 2),
            "output_tokens_per_step": round(tokens / len(step), 2),
            "host_ms_per_step": round(statistics.median(host) * 1e3, 3),
            "step_ms": round(statistics.median(step) * 1e3, 3),
            "host_share": round(sum(host) / sum(step), 4),
            "schedule_share": round(sum(p.get("schedule", 0.0) for p in phases)
                                    / sum(step), 4),
            "host_phases_ms": phase_medians(phases),
            "compiles_during_run": CompileCounter.count() - c0,
            "preemptions": engine.scheduler.num_preemptions - p0}


def sized_config(base, workload, max_batch: int):
    """The CLI's EngineConfig sized for this workload at max_batch rows."""
    return base.replace(num_pages=pool_pages(workload, max_batch, base.page_size),
                        max_model_len=max(len(p) + o for p, o in workload) + 1,
                        max_num_seqs=max_batch, enable_prefix_caching=False)


def bench_max_batch(loaded, workload, args, base, max_batch: int) -> list[dict]:
    cfg, graphdef, params, tokenizer = loaded
    engine = Engine(cfg, sized_config(base, workload, max_batch), graphdef, params, tokenizer,
                    model_name=args.model)
    warm = engine.warmup(progress=False)
    print(f"max_batch {max_batch}: compiled {warm['buckets']} buckets in "
          f"{warm['seconds']:.1f}s", file=sys.stderr, flush=True)
    return [dict(measure(engine, workload, mode, max_batch), warmup_s=round(warm["seconds"], 1))
            for mode in ("continuous", "static")]


def run(args) -> int:
    base = engine_config(args)
    loaded = load_model(args.model, base)
    workload = make_workload(args, loaded[0].vocab_size)
    result = new_result(
        args, model=args.model, dtype=base.dtype, weights=args.weights,
        kv_dtype=args.kv_dtype, async_scheduling=base.async_scheduling,
        workload={"requests": len(workload), "seed": args.seed, "sigma": args.sigma,
                  "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
                  "prompt_median": args.prompt_median, "output_median": args.output_median,
                  "prompt_tokens": sum(len(p) for p, _ in workload),
                  "output_tokens": sum(o for _, o in workload)},
        max_num_batched_tokens=base.max_num_batched_tokens, page_size=base.page_size,
        continuous_over_static={})
    for b in args.max_batch:
        rows = bench_max_batch(loaded, workload, args, base, b)
        gc.collect()  # the engine (and its KV pool) is gone before the next one is built
        result["continuous_over_static"][str(b)] = round(
            rows[0]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"], 3)
        save(result, args.out, rows)
    print_table(result["rows"], KEYS)
    print(f"continuous over static: {result['continuous_over_static']}")
    return 0
