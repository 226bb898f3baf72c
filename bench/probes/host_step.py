"""Host and device time of the batch-1 decode step in this process's XLA settings.

    JAXINFER_XLA_PDL=0 python -m bench.probes.host_step --model llama-3-8b --dtype bfloat16 \
        --weights fp8 [--context 512] [--rounds 5] [--out host_step.json] [--git SHA]

For A/B runs of settings that only a fresh process can change (XLA_FLAGS, e.g. PDL:
jaxinfer/__init__.py): run it once per setting. One row: the medians over the rounds of
bench.decode.step_times (synced_ms, device_ms, burst_ms) and of outputs_ab.idle_enqueue_ms,
the setting (`pdl`, `xla_flags`), and every round's numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

from bench.common import decode_input, fill_kv, load_runner
from bench.decode import step_times
from bench.probes import write_probe
from bench.probes.outputs_ab import idle_enqueue_ms
from jaxinfer.cli import add_engine_args

METRICS = ("synced_ms", "device_ms", "burst_ms", "idle_enqueue_ms")


def run(args) -> list[dict]:
    runner, cfg, _ = load_runner(args, max_num_seqs=1, max_len=args.context + 1,
                                 pairs=[(1, args.context)], kv_budget_gb=4)
    runner.kv = fill_kv(runner.kv)
    inp = runner.prepare(decode_input(cfg, runner.engine, 1, args.context,
                                      np.random.default_rng(0)))
    runner.step(inp)
    runner.step(inp)
    rounds = []
    for _ in range(args.rounds):
        synced, device, burst = step_times(runner, inp, 5)
        rounds.append(dict(zip(METRICS, (synced * 1e3, device * 1e3, burst * 1e3,
                                         idle_enqueue_ms(runner, inp)))))
    row = {"model": args.model, "weights": args.weights, "batch": 1, "context": args.context,
           "pdl": os.environ.get("JAXINFER_XLA_PDL", "1"),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           **{m: round(statistics.median(r[m] for r in rounds), 4) for m in METRICS},
           "rounds": rounds}
    print({k: v for k, v in row.items() if k != "rounds"}, flush=True)
    return [row]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap)
    ap.add_argument("--context", type=int, default=512, help="the decode row's context")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (median)")
    ap.add_argument("--out", default="host_step.json")
    ap.add_argument("--git", default=None)
    args = ap.parse_args(argv)
    if args.context < 1 or args.rounds < 1:
        ap.error("--context and --rounds must be >= 1")
    write_probe(args.out, "host_step", args.git, argv, run(args))


if __name__ == "__main__":
    main()
