"""Host and device time of the batch-1 decode step in this process's XLA settings.

    JAXINFER_XLA_PDL=0 python -m bench.probes.host_step --model llama-3-8b --dtype bfloat16 \
        --weights fp8 [--context 512] [--rounds 5] [--out host_step.json] [--git SHA]

For A/B runs of settings that only a fresh process can change (XLA_FLAGS, e.g. PDL:
jaxinfer/__init__.py): run it once per setting. One row: the medians over the rounds of
outputs_ab's four measurements (METRICS: synced, device, burst dispatch, idle enqueue), the
setting (`pdl`, `xla_flags`), and every round's numbers.
"""
from __future__ import annotations

import os
import statistics

from bench.common import load_runner
from bench.probes import write_probe
from bench.probes.outputs_ab import METRICS, measure, parse_args, warm_input


def run(args) -> list[dict]:
    runner, cfg, _ = load_runner(args, max_num_seqs=1, max_len=args.context + 1,
                                 pairs=[(1, args.context)], kv_budget_gb=4)
    inp = warm_input(runner, cfg, args.context)
    rounds = [measure(runner, inp) for _ in range(args.rounds)]
    row = {"model": args.model, "weights": args.weights, "batch": 1, "context": args.context,
           "pdl": os.environ.get("JAXINFER_XLA_PDL", "1"),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           **{m: round(statistics.median(r[m] for r in rounds), 4) for m in METRICS},
           "rounds": rounds}
    print({k: v for k, v in row.items() if k != "rounds"}, flush=True)
    return [row]


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, rounds=5, out="host_step.json")
    write_probe(args.out, "host_step", args.git, argv, run(args))


if __name__ == "__main__":
    main()
