"""`jaxinfer bench host`: the host's work per decode step at --max-num-seqs rows, alone. No
device step runs (each step's tokens are given), so nothing else shares the host: per phase,
the median over --steps steps of schedule (Scheduler.schedule), prepare_arrays
(batch.prepare), prepare_input (build_step_input), prepare_transfer (ModelRunner.prepare:
the packing and its one transfer, not waited for), commit and resolve (the scheduler's), and
their total. `python_loop_ms` times a fixed pure-Python loop: a yardstick of the machine's
single-thread speed. Set beside `jaxinfer bench throughput`'s host_phases_ms on the same
machine, the difference is what a running engine adds around the same Python (the device
runtime's threads, the dispatch, waits for the GIL)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from bench.common import engine_config, new_result, print_table, save
from jaxinfer import batch
from jaxinfer.engine import Engine
from jaxinfer.engine_io import build_step_input, pending_source
from jaxinfer.request import SamplingParams

PHASES = ("schedule", "prepare_arrays", "prepare_input", "prepare_transfer", "commit",
          "resolve")
KEYS = ["rows", "steps", *(f"{p}_ms" for p in PHASES), "total_ms", "python_loop_ms"]
WARM_STEPS = 8


def python_loop_ms(n: int = 1_000_000) -> float:
    """Milliseconds of a pure-Python loop of n additions (median of 3)."""
    times = []
    for _ in range(3):
        t, s = time.perf_counter(), 0
        for i in range(n):
            s += i
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure(engine: Engine, steps: int) -> dict[str, list[float]]:
    """Seconds of each phase for `steps` decode steps of every running request."""
    s, runner, vocab = engine.scheduler, engine.runner, engine.model_config.vocab_size
    clock, seconds = time.perf_counter, {p: [] for p in PHASES}
    tables = batch.PageTables()      # as the engine keeps them
    for i in range(WARM_STEPS + steps):
        t0 = clock()
        out = s.schedule()
        t1 = clock()
        if out.num_tokens != out.num_rows or out.num_rows != engine.config.max_num_seqs:
            raise RuntimeError(f"step {i} is not a decode step of every row: {out.num_rows} "
                               f"rows, {out.num_tokens} tokens")
        bucket = engine.buckets.choose(out.num_tokens, out.num_rows, out.max_pages)
        arrays = batch.prepare(out, bucket, engine.config.page_size, tables)
        t2 = clock()
        inp = build_step_input(arrays, out, s, *pending_source(None, None, runner.no_prev, out,
                                                               arrays), vocab)
        t3 = clock()
        runner.prepare(inp)
        t4 = clock()
        s.commit(out)
        t5 = clock()
        s.resolve(out, [3] * out.num_rows)
        t6 = clock()
        if i >= WARM_STEPS:
            for p, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5),
                                          (t5, t6))):
                seconds[p].append(b - a)
    return seconds


def run(args) -> int:
    cfg = engine_config(args)
    # the prompts' steps give their first rows tokens too: every row must outlast them all
    prompt_steps = -(-cfg.max_num_seqs * args.input_len // cfg.max_num_batched_tokens)
    if cfg.max_model_len < args.input_len + prompt_steps + WARM_STEPS + args.steps + 1:
        raise SystemExit(f"jaxinfer bench host: --max-model-len {cfg.max_model_len} is too "
                         f"short for --input-len {args.input_len} and {args.steps} steps")
    engine = Engine.from_model(args.model, cfg)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=cfg.max_model_len - args.input_len, temperature=0.0,
                            ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for _ in range(cfg.max_num_seqs):
        engine.add_request({"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()},
                           params)
    # the prompts in, so that every step after this is a decode step of every row
    while engine.scheduler.waiting or any(r.num_uncomputed_tokens > 1
                                          for r in engine.scheduler.running):
        out = engine.scheduler.schedule()
        engine.scheduler.commit(out)
        engine.scheduler.resolve(out, [3] * out.num_rows)
    seconds = measure(engine, args.steps)
    row = {"rows": cfg.max_num_seqs, "steps": args.steps,
           **{f"{p}_ms": round(1e3 * statistics.median(v), 4) for p, v in seconds.items()}}
    row["total_ms"] = round(sum(row[f"{p}_ms"] for p in PHASES), 4)
    row["python_loop_ms"] = round(python_loop_ms(), 2)
    result = new_result(args, model=args.model, input_len=args.input_len)
    save(result, args.out, [row])
    print_table(result["rows"], KEYS)
    return 0
