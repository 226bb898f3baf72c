"""`jaxinfer bench SUITE`: compile, decode, fusion, prefill (see bench/README.md).

Wiring (jaxinfer/cli.py): `b = sub.add_parser("bench", ...); add_bench_arguments(b);
b.set_defaults(func=run_bench)`. Also runnable as `python -m bench.cli SUITE ...`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from bench.common import RESULTS_DIR, parse_ints

SUITES = {
    "compile": ("bench.compile_suite", "trace / lower / compile seconds of every bucket, cold "
                "and warm (persistent cache), and what the compiled step contains"),
    "decode": ("bench.decode", "decode step time, tokens/s, MBU and the roofline plot over "
               "batch sizes x contexts"),
    "fusion": ("bench.fusion", "the decode step fused vs op by op vs command buffers off: "
               "step time and kernels per step"),
    "prefill": ("bench.prefill", "TTFT vs prompt length and bucket padding waste"),
    "profile": ("bench.profile", "where one decode step's device time goes, kernel by kernel "
                "(jax.profiler trace, summed by category)"),
}
# (GPU, CPU) defaults per suite; prefill's contexts are prompt lengths.
DEFAULTS = {
    "decode": ({"batch_sizes": "1,8,64,256", "contexts": "128,512,1024,2048,8192"},
               {"batch_sizes": "1,4", "contexts": "16,64"}),
    "fusion": ({"batch_sizes": "1", "contexts": "512"}, {"batch_sizes": "1", "contexts": "16"}),
    "prefill": ({"batch_sizes": "1", "contexts": "128,512,1024,2048"},
                {"batch_sizes": "1", "contexts": "8,40"}),
    "compile": ({"batch_sizes": "1", "contexts": "1"}, {"batch_sizes": "1", "contexts": "1"}),
    "profile": ({"batch_sizes": "1,64", "contexts": "512"}, {"batch_sizes": "1", "contexts": "16"}),
}


def _ints(text: str) -> list[int]:
    try:
        return parse_ints(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxinfer.cli import add_engine_args

    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (_, help_text) in SUITES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--out", default=str(RESULTS_DIR / f"{name}.json"),
                       help="results JSON (default bench/results/SUITE.json)")
        p.add_argument("--git", default=None,
                       help="git sha to record (default: git rev-parse HEAD)")
        gpu, cpu = DEFAULTS[name]
        p.add_argument("--batch-sizes", type=_ints, default=None,
                       help=f"comma-separated batch sizes (default: {gpu['batch_sizes']} on "
                            f"GPU, {cpu['batch_sizes']} on CPU)")
        what = " (prompt lengths)" if name == "prefill" else ""
        p.add_argument("--contexts", type=_ints, default=None,
                       help=f"comma-separated context lengths{what} "
                            f"(default: {gpu['contexts']} on GPU, {cpu['contexts']} on CPU)")
        p.add_argument("--reps", type=int, default=10, help="timed repeats per case (median)")
        p.add_argument("--kv-budget-gb", type=float, default=None,
                       help="largest KV pool to allocate; cases beyond it are skipped "
                            "(default: 48 on GPU, 1 on CPU)")
        _SUITE_ARGS.get(name, lambda p: None)(p)
        add_engine_args(p)


def _compile_args(p):
    p.add_argument("--no-warm", action="store_true",
                   help="skip the start-up compile child processes (cold and warm cache)")
    p.add_argument("--cache-dir", default=None,
                   help="persistent compilation cache dir (default: a fresh temp dir)")
    p.add_argument("--phase", choices=("cold", "warm"), default=None,
                   help=argparse.SUPPRESS)  # internal: the start-up compile child processes


def _fusion_args(p):
    p.add_argument("--no-unfused", action="store_true", help="skip the op-by-op baseline")
    p.add_argument("--no-cmdbuf-child", action="store_true",
                   help="skip the command-buffers-off child process")
    p.add_argument("--child", choices=("cmdbuf_off",), default=None, help=argparse.SUPPRESS)


def _decode_args(p):
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to an existing --out file (one decode.json for "
                        "several models / formats; each run keeps its command and ceilings)")


_SUITE_ARGS = {"compile": _compile_args, "fusion": _fusion_args, "decode": _decode_args}


def _fill_defaults(args) -> None:
    import jax

    gpu = jax.default_backend() == "gpu"
    defaults = DEFAULTS[args.suite][0 if gpu else 1]
    if args.batch_sizes is None:
        args.batch_sizes = parse_ints(defaults["batch_sizes"])
    if args.contexts is None:
        args.contexts = parse_ints(defaults["contexts"])
    if args.kv_budget_gb is None:
        args.kv_budget_gb = 48.0 if gpu else 1.0


def run_bench(args) -> int:
    _fill_defaults(args)
    return importlib.import_module(SUITES[args.suite][0]).run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxinfer bench", description=__doc__.splitlines()[0])
    add_bench_arguments(p)
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
