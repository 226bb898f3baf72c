"""Persistent step outputs on and off (runner.PERSISTENT_OUTPUTS), one process, interleaved.

    python -m bench.probes.outputs_ab --model llama-3-8b --dtype bfloat16 --weights fp8 \
        [--context 512] [--rounds 6] [--out bench/results/outputs_ab.json] [--git SHA]

Two ModelRunners over the same params at batch 1 (the decode harness's input), one writing
the step's results into donated persistent buffers and copying them out, one with fresh
outputs (as before 782d6c6); each round measures both, in alternating order:
  synced_ms          a step and its device->host fetch (the harness's `step_ms`)
  device_ms          steps back to back (the harness's `step_ms_device`)
  burst_dispatch_ms  the host's time per step enqueuing a burst of 8 (`dispatch_ms`)
  idle_enqueue_ms    the host's time of one dispatch with the device idle (median of 30)
Rows: per arm the medians over the rounds and every round's samples. What the change moves
is the host's part (XLA no longer updates the step's command buffer each call:
bench/probes/dispatch.py counts that); the device step should not move.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from bench.common import decode_input, fill_kv, load_runner
from bench.decode import step_times
from bench.probes import write_probe
from jaxinfer import runner as runner_mod
from jaxinfer.cli import add_engine_args

METRICS = ("synced_ms", "device_ms", "burst_dispatch_ms", "idle_enqueue_ms")


def idle_enqueue_ms(runner, inp, n: int = 30) -> float:
    """Median host ms of one dispatch with the device idle (blocked on before each)."""
    times, kv = [], runner.kv
    for i in range(n):
        jax.block_until_ready(kv)
        t = time.perf_counter()
        kv, _, _ = runner.dispatch(kv, inp, i)
        times.append(time.perf_counter() - t)
    runner.kv = jax.block_until_ready(kv)
    return statistics.median(times) * 1e3


def measure(runner, inp) -> dict[str, float]:
    synced, device, dispatch = step_times(runner, inp, 5)
    return {"synced_ms": synced * 1e3, "device_ms": device * 1e3,
            "burst_dispatch_ms": dispatch * 1e3, "idle_enqueue_ms": idle_enqueue_ms(runner, inp)}


def warm_input(runner, cfg, context: int):
    """The decode harness's batch-1 input at `context`, prepared, with the runner's cache
    filled and the step run twice (compiled, buffers made)."""
    runner.kv = fill_kv(runner.kv)
    inp = runner.prepare(decode_input(cfg, runner.engine, 1, context, np.random.default_rng(0)))
    runner.step(inp)
    runner.step(inp)
    return inp


def build(args, context: int) -> dict:
    """{'on': (runner, input), 'off': (runner, input)}: runners over the same params, each
    with its warm_input."""
    saved = runner_mod.PERSISTENT_OUTPUTS
    try:
        runner_mod.PERSISTENT_OUTPUTS = True
        on, cfg, graphdef = load_runner(args, max_num_seqs=1, max_len=context + 1,
                                        pairs=[(1, context)], kv_budget_gb=4)
        runner_mod.PERSISTENT_OUTPUTS = False
        off = runner_mod.ModelRunner(cfg, on.engine, graphdef, on.params)
    finally:
        runner_mod.PERSISTENT_OUTPUTS = saved
    return {arm: (r, warm_input(r, cfg, context)) for arm, r in (("on", on), ("off", off))}


def run(args, context: int, rounds: int) -> list[dict]:
    runners = build(args, context)
    samples = {arm: {m: [] for m in METRICS} for arm in runners}
    for rnd in range(rounds):
        for arm in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            for m, v in measure(*runners[arm]).items():
                samples[arm][m].append(round(v, 4))
    rows = []
    for arm, d in samples.items():
        rows.append({"model": args.model, "weights": args.weights,
                     "kv_dtype": args.kv_dtype, "batch": 1, "context": context,
                     "persistent_outputs": arm == "on", "rounds": rounds,
                     **{m: round(statistics.median(v), 4) for m, v in d.items()},
                     "samples": d})
        print({k: v for k, v in rows[-1].items() if k != "samples"}, flush=True)
    return rows


def parse_args(doc: str, argv, *, rounds: int, out: str):
    """The batch-1 probes' command line (this one's and host_step's): the engine's flags,
    --context, --rounds (median), --out, --git."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_engine_args(ap)
    ap.add_argument("--context", type=int, default=512, help="the decode row's context")
    ap.add_argument("--rounds", type=int, default=rounds, help="rounds (median)")
    ap.add_argument("--out", default=out)
    ap.add_argument("--git", default=None)
    args = ap.parse_args(argv)
    if args.context < 1 or args.rounds < 1:
        ap.error("--context and --rounds must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, rounds=6, out="bench/results/outputs_ab.json")
    write_probe(args.out, "outputs_ab", args.git, argv,
                run(args, args.context, args.rounds))


if __name__ == "__main__":
    main()
