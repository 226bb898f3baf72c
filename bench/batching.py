"""Continuous vs static batching on one engine: output tokens/s on a heterogeneous workload.

    python -m bench.batching --model llama-3-8b --max-batch 16,32 --num-requests 1536 \
        --out bench/results/batching.json       # H200, bf16 synthetic weights, ~8 min
    python -m bench.batching --model tiny --num-requests 8 --max-batch 4 \
        --prompt-len 4,48 --output-len 2,12 --max-num-batched-tokens 64 --out /tmp/b.json

Workload (seeded): prompt and output lengths log-normal around the given medians, clipped to
[min, max]; random prompt tokens; greedy, ignore_eos, so every request emits exactly its
output length. Both modes run the same requests on the same engine (same EngineConfig,
prefix caching off so the second mode cannot reuse the first one's pages; a KV pool large
enough for the max_batch longest requests, so nothing is preempted):

  continuous  every request queued at t=0; the engine admits one as soon as a row frees up.
  static      groups of max_batch requests, in order; a group starts only when the previous
              one has finished, so rows freed by short answers idle until the longest ends.

Every bucket is compiled (engine.warmup) before timing and the compile count during the timed
runs is recorded (it should be 0). Per mode: output tokens / wall time, medians of the host
part of a step (engine.last_host_s: schedule, batch prep, device transfer, update: the time
`engine.step()` did not spend waiting for a step's tokens) and of the whole step
(engine.last_step_s), the host share of all step time, the scheduler's own share
(`schedule_share`: Scheduler.schedule's time over all step time) and each host phase's median
(`host_phases_ms`, Engine.last_phases). With async scheduling (the default;
--no-async-scheduling turns it off) the host part overlaps the device step.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time

import jax
import numpy as np

from bench.common import git_sha
from jaxinfer.config import LM_HEADS, EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.request import Request, SamplingParams
from jaxinfer.runner import CompileCounter
from jaxinfer.scheduler import Scheduler


def lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)], seeded."""
    rng = np.random.default_rng(args.seed)
    p_lo, p_hi = args.prompt_len
    o_lo, o_hi = args.output_len
    plens = lognormal_lengths(rng, args.num_requests, args.prompt_median, args.sigma, p_lo, p_hi)
    olens = lognormal_lengths(rng, args.num_requests, args.output_median, args.sigma, o_lo, o_hi)
    return [(rng.integers(3, vocab_size, p).tolist(), int(o)) for p, o in zip(plens, olens)]


def pool_pages(workload, max_batch: int, page_size: int) -> int:
    """Pages for the max_batch longest requests at once (+ the reserved page 0)."""
    pages = sorted((-(-(len(p) + o) // page_size) for p, o in workload), reverse=True)
    return sum(pages[:max_batch]) + 1


def exact_length(n: int) -> SamplingParams:
    """Greedy, EOS ignored: the request emits exactly n tokens."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def mode_groups(workload, mode: str, max_batch: int) -> list:
    """continuous: the whole workload queued at once; static: groups of max_batch, in order,
    each run to its end before the next is queued."""
    return [workload] if mode == "continuous" else [
        workload[i:i + max_batch] for i in range(0, len(workload), max_batch)]


def drive(engine: Engine, requests) -> dict:
    """Queue `requests`, step until all are done; per-step host and total seconds."""
    for prompt, n in requests:
        engine.add_request({"prompt_token_ids": prompt}, exact_length(n))
    host, step, phases, tokens = [], [], [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        tokens += len(outs)
        host.append(engine.last_host_s)
        step.append(engine.last_step_s)
        phases.append(engine.last_phases)
    return {"host": host, "step": step, "phases": phases, "tokens": tokens}


def phase_medians(phases: list[dict]) -> dict:
    """Median milliseconds of each of Engine.last_phases' parts over the steps."""
    return {k: round(statistics.median(p[k] for p in phases) * 1e3, 3)
            for k in (phases[0] if phases else {})}


def measure(engine: Engine, workload, mode: str, max_batch: int) -> dict:
    groups = mode_groups(workload, mode, max_batch)
    c0, p0 = CompileCounter.count(), engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    runs = [drive(engine, g) for g in groups]
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
            # the scheduler's own part (Scheduler.schedule) of all step time, and every
            # host phase's median (Engine.last_phases)
            "schedule_share": round(sum(p.get("schedule", 0.0) for p in phases)
                                    / sum(step), 4),
            "host_phases_ms": phase_medians(phases),
            "compiles_during_run": CompileCounter.count() - c0,
            "preemptions": engine.scheduler.num_preemptions - p0}


def engine_config(args, workload, max_batch: int, dtype: str) -> EngineConfig:
    return EngineConfig(
        page_size=args.page_size, num_pages=pool_pages(workload, max_batch, args.page_size),
        max_model_len=max(len(p) + o for p, o in workload) + 1, max_num_seqs=max_batch,
        max_num_batched_tokens=args.max_num_batched_tokens, dtype=dtype, weights=args.weights,
        kv_dtype=args.kv_dtype, kv_scales=args.kv_scales, lm_head=args.lm_head,
        attention_impl=args.attention,
        enable_prefix_caching=False, async_scheduling=not args.no_async_scheduling)


def replay(cfg: EngineConfig, group) -> list[tuple[int, int, int]]:
    """Run `group` [(prompt ids, output length)] through a fresh Scheduler alone (no model,
    no device; every sampled token a dummy, which changes nothing for greedy, ignore_eos
    requests without prefix caching), all queued at once. One (decode rows, their context
    tokens, prefill-chunk tokens) per step: what the steps hold, without timing them."""
    sched = Scheduler.from_config(cfg)
    for i, (prompt, n) in enumerate(group):
        sched.add(Request(f"r{i}", prompt, exact_length(n), arrival_time=float(i)))
    steps = []
    while sched.has_unfinished:
        step = sched.schedule()
        decode = [r for r in step.rows if r.num_tokens == 1]
        steps.append((len(decode), sum(r.seq_len for r in decode),
                      step.num_tokens - len(decode)))
        sched.update(step, [0] * len(step.rows))
    return steps


def step_counts(steps) -> dict:
    """replay's steps counted: how many carry a prefill chunk (and its mean tokens) and how
    many rows the decode-only ones hold on average."""
    decode_rows = [rows for rows, _, chunk in steps if not chunk]
    prefill = [chunk for _, _, chunk in steps if chunk]
    return {"steps": len(steps), "steps_with_prefill": len(prefill),
            "prefill_tokens_per_such_step": round(sum(prefill) / max(len(prefill), 1), 1),
            "decode_only_steps": len(decode_rows),
            "decode_only_mean_rows": round(float(np.mean(decode_rows or [0])), 2)}


def simulate(workload, args, max_batch: int) -> list[dict]:
    """Per mode, where replay's steps go (step_counts) and the decode-only steps by rows:
    a mode's steps without timing them."""
    cfg = engine_config(args, workload, max_batch, "float32")
    out = []
    for mode in ("continuous", "static"):
        steps = [s for group in mode_groups(workload, mode, max_batch)
                 for s in replay(cfg, group)]
        decode_rows = [rows for rows, _, chunk in steps if not chunk]
        # decode-only steps by their rows, in quarters of max_batch (64: <16, 16-31, ...)
        q = [max_batch * k // 4 for k in range(1, 4)]
        hist = np.histogram(decode_rows, bins=[0, *q, max_batch + 1])[0]
        labels = [f"<{q[0]}", f"{q[0]}-{q[1] - 1}", f"{q[1]}-{q[2] - 1}", f"{q[2]}-{max_batch}"]
        out.append({"mode": mode, "max_batch": max_batch, **step_counts(steps),
                    "decode_only_steps_by_rows": dict(zip(labels, map(int, hist)))})
    return out


def int_pair(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= min <= max, got {s!r}")
    return lo, hi


def add_engine_flags(ap: argparse.ArgumentParser, *, model: str, weights: str,
                     kv_dtype: str) -> None:
    """The engine flags this bench and bench.throughput share (`engine_config` reads them)."""
    ap.add_argument("--model", default=model, help="a standard shape (synthetic weights) or "
                                                   "any --model the CLI takes")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default=weights)
    ap.add_argument("--kv-dtype", choices=("auto", "bf16", "fp8"), default=kv_dtype)
    ap.add_argument("--kv-scales", choices=("static", "token"), default="static",
                    help="FP8 KV scales: one per layer and kv head (calibrated) or per token")
    ap.add_argument("--lm-head", choices=LM_HEADS, default="bf16",
                    help="LM head weights: bf16, int8 per vocab row, or auto (as the CLI's "
                         "flag)")
    ap.add_argument("--attention", choices=("auto", "reference", "pallas"), default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="token budget per step (decode rows + prefill chunks)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="the synchronous engine (default: host prepares step t+1 while t runs)")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, model="tiny", weights="bf16", kv_dtype="auto")
    ap.add_argument("--max-batch", default="64", help="comma-separated max_num_seqs values")
    ap.add_argument("--num-requests", type=int, default=384)
    ap.add_argument("--prompt-len", type=int_pair, default=(16, 2048), help="min,max")
    ap.add_argument("--output-len", type=int_pair, default=(8, 512), help="min,max")
    ap.add_argument("--prompt-median", type=float, default=256.0)
    ap.add_argument("--output-median", type=float, default=64.0)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of both lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--git", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", default="bench/results/batching.json")
    ap.add_argument("--simulate", action="store_true",
                    help="replay the workload through the scheduler alone (no model, no "
                         "device) and print each mode's steps and decode-row occupancy; "
                         "writes nothing")
    return ap.parse_args(argv)


def save(result: dict, path: str) -> None:
    """Rewrite the whole file after each row, so a run cut short still leaves its numbers."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def bench_max_batch(model, workload, args, max_batch: int, dtype: str) -> list[dict]:
    model_cfg, graphdef, params, tokenizer = model
    engine = Engine(model_cfg, engine_config(args, workload, max_batch, dtype), graphdef, params,
                    tokenizer, model_name=args.model)
    warm = engine.warmup(progress=False)
    print(f"max_batch {max_batch}: compiled {warm['buckets']} buckets in "
          f"{warm['seconds']:.1f}s", file=sys.stderr, flush=True)
    rows = []
    for mode in ("continuous", "static"):
        rows.append(dict(measure(engine, workload, mode, max_batch),
                         warmup_s=round(warm["seconds"], 1)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.simulate:   # lengths do not depend on the vocabulary: any size replays the run
        workload = make_workload(args, 1000)
        rows = [r for b in args.max_batch.split(",") for r in simulate(workload, args, int(b))]
        for r in rows:
            print(json.dumps(r), flush=True)
        return {"rows": rows}
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    batches = [int(b) for b in args.max_batch.split(",")]
    loaded = load_model(args.model, EngineConfig(dtype=dtype, weights=args.weights,
                                                 lm_head=args.lm_head))
    workload = make_workload(args, loaded[0].vocab_size)
    result = {
        "suite": "batching", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "git": git_sha(args.git), "date": str(datetime.date.today()),
        "command": "python -m bench.batching " + " ".join(argv if argv is not None
                                                          else sys.argv[1:]),
        "model": args.model, "dtype": dtype, "weights": args.weights, "kv_dtype": args.kv_dtype,
        "async_scheduling": not args.no_async_scheduling,
        "workload": {"requests": len(workload), "seed": args.seed, "sigma": args.sigma,
                     "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
                     "prompt_median": args.prompt_median, "output_median": args.output_median,
                     "prompt_tokens": sum(len(p) for p, _ in workload),
                     "output_tokens": sum(o for _, o in workload)},
        "max_num_batched_tokens": args.max_num_batched_tokens, "page_size": args.page_size,
        "rows": [], "continuous_over_static": {}}
    for b in batches:
        rows = bench_max_batch(loaded, workload, args, b, dtype)
        gc.collect()  # the engine (and its KV pool) is gone before the next one is built
        result["rows"] += rows
        result["continuous_over_static"][str(b)] = round(
            rows[0]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"], 3)
        save(result, args.out)
    print(json.dumps(result["continuous_over_static"]), flush=True)
    return result


if __name__ == "__main__":
    main()
