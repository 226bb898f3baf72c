"""The host side of one engine step at many decode rows, without a device (CPU timing).

    python -m bench.host_step [--rows 256] [--context 1500] [--steps 60] [--profile]

Fills a Scheduler with `rows` requests of ~`context` prompt tokens, prefills them (fake
tokens), then times steady decode steps: schedule, batch.prepare, the step input
(engine_io.build_step_input: sampling columns), packing it into one buffer
(step_input.pack_host) and the scheduler's update (commit + resolve). No model, no transfer,
no dispatch, no detokenization: the part of the engine's host phases that is pure Python and
numpy, so it can be measured and improved on any machine. Prints medians in ms;
--profile prints cProfile's top functions instead.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from jaxinfer.batch import prepare
from jaxinfer.buckets import Buckets
from jaxinfer.engine_io import build_step_input
from jaxinfer.request import Request, SamplingParams
from jaxinfer.step_input import pack_host
from jaxinfer.scheduler import Scheduler

PHASES = ("schedule", "prepare", "step_input", "pack", "update")


def make_scheduler(rows: int, context: int, page_size: int = 16, seed: int = 0):
    """A scheduler whose `rows` requests are all past prefill (one token per step)."""
    max_len = context + 700
    sched = Scheduler(max_num_seqs=rows, max_num_batched_tokens=2048, page_size=page_size,
                      num_pages=rows * (-(-max_len // page_size)) + 1, max_model_len=max_len)
    rng = np.random.default_rng(seed)
    for i in range(rows):
        n = context - 64 + int(rng.integers(0, 128))
        sched.add(Request(f"r{i}", [int(x) for x in rng.integers(1, 1000, n)],
                          SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)))
    while sched.waiting or any(r.num_uncomputed_tokens > 1 for r in sched.running):
        out = sched.schedule()
        sched.update(out, [5] * out.num_rows)
    buckets = Buckets(rows, 2048, -(-max_len // page_size))
    return sched, buckets


def step_times(sched, buckets) -> np.ndarray:
    """One decode step's host phases, seconds."""
    t = [time.perf_counter()]
    out = sched.schedule()
    t.append(time.perf_counter())
    arrays = prepare(out, buckets.choose(out.num_tokens, out.num_rows, out.max_pages),
                     sched.page_size)
    t.append(time.perf_counter())
    inp = build_step_input(arrays, out, sched, np.zeros(sched.max_num_seqs, np.int32),
                           np.full(len(arrays.tokens), -1, np.int32))
    t.append(time.perf_counter())
    pack_host(inp)
    t.append(time.perf_counter())
    sched.update(out, [7] * out.num_rows)
    t.append(time.perf_counter())
    return np.diff(t)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256, help="decode rows per step")
    ap.add_argument("--context", type=int, default=1500, help="~prompt tokens per request")
    ap.add_argument("--steps", type=int, default=60, help="timed steps (after 10 warm-up)")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = ap.parse_args(argv)
    if args.rows < 1 or args.context < 128 or args.steps < 1:
        ap.error("--rows >= 1, --context >= 128 and --steps >= 1")
    sched, buckets = make_scheduler(args.rows, args.context)
    for _ in range(10):
        step_times(sched, buckets)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [step_times(sched, buckets) for _ in range(args.steps)])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        return {}
    med = np.median([step_times(sched, buckets) for _ in range(args.steps)], axis=0) * 1e3
    result = {name: round(float(ms), 3) for name, ms in zip(PHASES, med)}
    result["total"] = round(float(med.sum()), 3)
    print(f"{args.rows} rows, ~{args.context} tokens each, median ms per step: "
          + " ".join(f"{k} {v:.3f}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
