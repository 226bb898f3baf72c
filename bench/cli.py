"""`jaxinfer bench SUITE`: the benchmark suites (bench/README.md).

jaxinfer/cli.py wires it in: `add_bench_arguments(parser)`, then `run_bench(args)`. Also
runnable as `python -m bench.cli SUITE ...`. This module stays light (no jax, no suite
imports) because every `jaxinfer` command builds its parser; a suite is imported when it runs.
"""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import tempfile
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_OUT_DIR = Path(tempfile.gettempdir()) / "jaxinfer-bench"

# suite -> (module, one line of help)
SUITES = {
    "compile": ("bench.compile_suite", "trace / lower / compile seconds of every bucket, cold "
                "and warm (persistent cache), and what the compiled step contains"),
    "decode": ("bench.decode", "decode step time, tokens/s and MBU over batch sizes x "
               "contexts, with a roofline plot"),
    "fusion": ("bench.fusion", "the decode step fused vs op by op vs command buffers off: "
               "step time and kernels per step"),
    "profile": ("bench.profile", "where one decode step's device time goes, kernel by kernel"),
    "paged_attention": ("bench.paged_attention", "paged decode attention: jaxinfer's Pallas "
                        "kernel vs JAX's bundled kernel vs the XLA reference"),
    "fp8_matmul": ("bench.fp8_matmul", "FP8-weight matmul: fp8_linear vs XLA bf16 vs XLA with "
                   "the dequant left to it"),
    "batching": ("bench.batching", "continuous vs static batching on one engine: output "
                 "tokens/s on a mixed-length workload"),
    "throughput": ("bench.throughput", "offline output tokens/s of the engine on a "
                   "fixed-length workload"),
    "host": ("bench.host", "the host's work per decode step (schedule, prepare, commit, "
             "resolve) at a batch size, alone: no device step runs"),
    "serving": ("bench.serving", "gRPC / HTTP serving under Poisson arrivals: latency percentiles "
                "vs request rate"),
    "lora": ("bench.lora", "output tokens/s serving LoRA adapters (rows spread over them) vs "
             "the same engine without LoRA"),
    "lora_kernels": ("bench.lora_kernels", "LoRA's update of one projection group: the Pallas "
                     "kernels vs XLA's form, per step size"),
    "sampling": ("bench.sampling", "what structured output (a JSON schema at batch 64) and "
                 "n > 1 (prompt tokens computed, TTFT) cost vs plain requests"),
    "speculative": ("bench.speculative", "speculative decoding: the verify step's cost vs a "
                    "decode step, and end-to-end tokens/s with vs without it"),
    "ray_affinity": ("bench.ray_affinity", "replicas under Ray Serve: the prefix cache's hit "
                     "rate with jaxinfer's prefix-affinity router vs Ray's default router"),
}
ALIASES = {"paged_attention": ["kernels"]}


def default_out(suite: str) -> Path:
    """Where a run writes without --out: outside the tree, so no committed record moves."""
    return DEFAULT_OUT_DIR / f"{suite}.json"


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def int_pair(text: str) -> tuple[int, int]:
    values = parse_ints(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with LO <= HI, got {text!r}")
    return values[0], values[1]


def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def _window(text: str) -> tuple[int, int]:
    first, _, count = text.partition(":")
    try:
        window = int(first), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:COUNT (e.g. 2000:40), got {text!r}")
    if window[0] < 0 or window[1] < 1:
        raise argparse.ArgumentTypeError(f"need FIRST >= 0 and COUNT >= 1, got {text!r}")
    return window


class _Help(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except where there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def _per_device(p, flag: str, gpu: str, cpu: str, help: str, type=parse_ints):
    """A flag whose default depends on the backend: the parser's `device_defaults` maps it
    to (GPU default, CPU default, type) for run_bench to resolve."""
    dest = flag.lstrip("-").replace("-", "_")
    p.set_defaults(device_defaults={**(p.get_default("device_defaults") or {}),
                                    dest: (gpu, cpu, type)})
    p.add_argument(flag, type=type, default=None,
                   help=f"{help} (default: {gpu} on a GPU, {cpu} on the CPU)")


def _grid(p, batches: tuple[str, str], contexts: tuple[str, str]):
    """The (batch, context) grid of the runner-based suites."""
    _per_device(p, "--batch-sizes", *batches, "comma-separated batch sizes")
    _per_device(p, "--contexts", *contexts, "comma-separated context lengths")
    p.add_argument("--reps", type=int, default=10, help="timed repeats per case (median)")
    _per_device(p, "--kv-budget-gb", "48", "1",
                "largest KV pool to allocate in GB; cases beyond it are skipped", type=float)


def _compile(p):
    p.add_argument("--no-warm", action="store_true",
                   help="skip the start-up compile child processes (cold and warm cache)")
    p.add_argument("--startup-only", action="store_true",
                   help="only the start-up children (cold and warm cache), not the serial "
                        "per-bucket compile and HLO analysis")
    p.add_argument("--cache-dir", default=None,
                   help="persistent compilation cache dir (default: a fresh temp dir)")
    p.add_argument("--phase", choices=("cold", "warm"), default=None, help=argparse.SUPPRESS)


def _decode(p):
    _grid(p, ("1,8,64,256", "1,4"), ("128,512,1024,2048,8192", "16,64"))
    p.add_argument("--append", action="store_true",
                   help="add this run to an existing --out file (one decode.json for several "
                        "models and formats; each run keeps its command and ceilings)")


def _fusion(p):
    _grid(p, ("1", "1"), ("512", "16"))
    p.add_argument("--no-unfused", action="store_true", help="skip the op-by-op baseline")
    p.add_argument("--no-cmdbuf-child", action="store_true",
                   help="skip the command-buffers-off child process")
    p.add_argument("--child", choices=("cmdbuf_off",), default=None, help=argparse.SUPPRESS)


def _profile(p):
    _grid(p, ("1,64", "1"), ("512", "16"))


def _paged_attention(p):
    _per_device(p, "--batch-sizes", "1,8,64,256", "1", "comma-separated batch sizes")
    _per_device(p, "--contexts", "512,2048,8192,32768", "64",
                "comma-separated context lengths")
    _per_device(p, "--impls", "jaxinfer,bundled,xla_reference", "jaxinfer,xla_reference",
                "comma-separated subset of jaxinfer, bundled, xla_reference",
                type=lambda t: t.split(","))


def _fp8_matmul(p):
    _per_device(p, "--shapes", "4096x6144,4096x4096,4096x28672,14336x4096", "256x512",
                "comma-separated KxN weight shapes", type=str)
    _per_device(p, "--ms", "1,8,16,32,64,128,2048", "1,16",
                "comma-separated token counts M")
    p.add_argument("--samples", type=int, default=5, help="timed samples per case (median)")
    p.add_argument("--rotate-mb", type=float, default=256.0,
                   help="weight bytes cycled per timed call, so L2 never holds the next one")
    p.add_argument("--max-rotate", type=int, default=16, help="most weight buffers cycled")


def _lora_kernels(p):
    p.add_argument("--model", default="llama-3-8b", help="the shapes: a config name")
    _per_device(p, "--rows", "1,8,16,64", "8", "comma-separated step sizes T")
    p.add_argument("--slots", type=int, default=8, help="adapter slots N")
    p.add_argument("--rank", type=int, default=16, help="rank R")
    _per_device(p, "--sets", "24", "2", "weight sets cycled per timed call", type=int)


def _batching(p):
    p.add_argument("--max-batch", type=parse_ints, default=[64],
                   help="comma-separated max_num_seqs values, one engine each "
                        "(--max-num-seqs is ignored)")
    p.add_argument("--num-requests", type=int, default=384)
    p.add_argument("--prompt-len", type=int_pair, default=(16, 2048), help="LO,HI tokens")
    p.add_argument("--output-len", type=int_pair, default=(8, 512), help="LO,HI tokens")
    p.add_argument("--prompt-median", type=float, default=256.0)
    p.add_argument("--output-median", type=float, default=64.0)
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of both lengths")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.set_defaults(max_num_batched_tokens=2048)


def _throughput(p):
    p.add_argument("--input-len", type=int, default=1000, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=1000, help="output tokens per request")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="stop dispatching steps this many seconds after start (load and "
                        "warmup included) and write a partial row")
    p.add_argument("--profile-steps", type=_window, default=None, metavar="FIRST:COUNT",
                   help="run those steps of the timed run under the profiler and add their "
                        "device time by kernel category to the row (slows them: not for "
                        "headline numbers)")
    p.add_argument("--api", action="store_true",
                   help="also measure the workload through the public API in the same run: "
                        "LLM(...) (load + warm-up), then its first generate() call")
    p.set_defaults(model="llama-3-8b", weights="fp8", kv_dtype="fp8", max_num_seqs=512,
                   max_num_batched_tokens=2048)


def _host(p):
    p.add_argument("--steps", type=int, default=200, help="decode steps timed")
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens per request")
    p.set_defaults(model="tiny", max_num_seqs=512, max_num_batched_tokens=2048,
                   max_model_len=512)


def _serving(p):
    p.add_argument("--rates", type=floats, default=[4, 8, 16, 24, 32, 48, 64],
                   help="request rates (per s) of the short workload")
    p.add_argument("--chat-rates", type=floats, default=None,
                   help="request rates of the chat workload (default: --rates)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--prompt-len", type=int_pair, default=(64, 512), help="short: LO,HI tokens")
    p.add_argument("--answer-len", type=int_pair, default=(4, 40), help="short: LO,HI tokens")
    p.add_argument("--chat-system-len", type=int, default=256, help="chat: shared prefix tokens")
    p.add_argument("--chat-user-len", type=int_pair, default=(32, 256), help="chat: LO,HI")
    p.add_argument("--chat-answer-len", type=int_pair, default=(64, 256), help="chat: LO,HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="per-request deadline (s); over gRPC it is also the server's deadline "
                        "for the request, which refuses (RESOURCE_EXHAUSTED) one it predicts "
                        "late: --timeout 0.5 measures admission against the 500 ms budget")
    p.add_argument("--no-early-stop", action="store_true",
                   help="run every rate even after the server saturates")
    p.add_argument("--protocol", choices=("grpc", "http", "both"), default="grpc",
                   help="drive the gRPC service, the OpenAI HTTP API, or both in turn")
    p.add_argument("--target", default=None, help="host:port of a running server (default: "
                   "start one here with the engine flags)")
    p.add_argument("--http-target", default=None,
                   help="host:port (or URL) of the running server's HTTP API, with --target")
    p.add_argument("--metrics-target", default=None,
                   help="host:port of the running server's Prometheus metrics, with --target: "
                        "the rows' step time, host share and bandwidth gauge")
    p.add_argument("--auth-token-file", default=None, help="bearer token for --target")
    p.add_argument("--tls-ca", default=None, help="CA / certificate for a TLS --target")


def _lora(p):
    _per_device(p, "--batch-sizes", "1,64", "1,4", "comma-separated batch sizes")
    p.add_argument("--adapters", type=int, default=8, help="random adapters the rows spread over")
    p.add_argument("--rank", type=int, default=16, help="their rank (every projection)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--profile", action="store_true",
                   help="run each mode's workload once more under the profiler and add its "
                        "kernel families per step to the row (not the timed run)")
    p.set_defaults(model="llama-3-8b")


def _speculative(p):
    _per_device(p, "--batch-sizes", "1,64", "1,4", "comma-separated batch sizes")
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens per request (synthetic weights)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--context", type=int, default=512,
                   help="context length of the verify-step timing")
    p.add_argument("--reps", type=int, default=10, help="timed repeats of the step timing")
    p.set_defaults(model="llama-3-8b", num_speculative_tokens=4)


def _ray_affinity(p):
    p.add_argument("--replicas", type=int, default=2, help="engine replicas")
    p.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    p.add_argument("--questions", type=int, default=8, help="user questions per system prompt")
    p.add_argument("--system-chars", type=int, default=600,
                   help="characters of each system prompt")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per answer")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(model="smollm2", max_num_seqs=8, max_num_batched_tokens=256,
                   max_model_len=1024)


def _sampling(p):
    p.add_argument("--cases", type=lambda t: t.split(","), default=["structured", "n"],
                   help="comma-separated subset of structured, n")
    _per_device(p, "--batch", "64", "4", "structured: requests at once", type=int)
    p.add_argument("--input-len", type=int, default=128, help="structured: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="structured: output tokens")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json for synthetic weights (structured output needs one)")
    p.add_argument("--n", type=int, default=4, help="n: completions per request")
    p.add_argument("--n-prompt-len", type=int, default=1000, help="n: prompt tokens")
    p.add_argument("--n-output-len", type=int, default=16, help="n: output tokens")
    p.add_argument("--reps", type=int, default=5, help="n: requests per mode (median)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(model="llama-3-8b", max_num_batched_tokens=1024)


_SUITE_ARGS = {"compile": _compile, "decode": _decode, "fusion": _fusion, "profile": _profile,
               "paged_attention": _paged_attention, "fp8_matmul": _fp8_matmul,
               "batching": _batching, "throughput": _throughput, "host": _host,
               "serving": _serving, "lora": _lora, "lora_kernels": _lora_kernels, "speculative": _speculative,
               "sampling": _sampling, "ray_affinity": _ray_affinity}
_OP_SUITES = ("paged_attention", "fp8_matmul", "lora_kernels")   # ops: no engine flags


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxinfer.args import add_engine_args

    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (_, help_text) in SUITES.items():
        p = sub.add_parser(name, aliases=ALIASES.get(name, []), help=help_text,
                           description=help_text, formatter_class=_Help)
        p.add_argument("--out", default=None,
                       help=f"results JSON (default: {default_out(name)}; name "
                            f"bench/results/{name}.json to update the committed record)")
        p.add_argument("--git", default=None,
                       help="git sha to record (default: git rev-parse HEAD)")
        if name not in _OP_SUITES:
            add_engine_args(p)
        _SUITE_ARGS[name](p)   # after the engine flags: its set_defaults override theirs
        p.set_defaults(suite=name)


def _command(args) -> str:
    """The command line that reproduces the run: bench.cli.main's argv, else sys.argv from
    the suite's name on."""
    argv = getattr(args, "bench_argv", None)
    if argv is None:
        names = {args.suite, *ALIASES.get(args.suite, [])}
        tail = sys.argv[1:]
        at = next((i for i, a in enumerate(tail) if a in names), None)
        argv = tail[at:] if at is not None else [args.suite]
    return shlex.join(["jaxinfer", "bench", *argv])


def _fill_defaults(args) -> None:
    import jax

    gpu = jax.default_backend() == "gpu"
    for dest, (on_gpu, on_cpu, kind) in getattr(args, "device_defaults", {}).items():
        if getattr(args, dest) is None:
            setattr(args, dest, kind(on_gpu if gpu else on_cpu))


def run_bench(args) -> int:
    _fill_defaults(args)
    args.command = _command(args)
    args.out = Path(args.out) if args.out else default_out(args.suite)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rc = importlib.import_module(SUITES[args.suite][0]).run(args)
    if getattr(args, "phase", None) or getattr(args, "child", None):
        return rc   # a suite's own child process: its parent reports
    if args.out.exists():
        from bench import plots
        png = plots.write(args.out)
        print(f"results: {args.out}" + (f"\nplot: {png}" if png else ""))
    return rc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="jaxinfer bench", description=__doc__.splitlines()[0])
    add_bench_arguments(p)
    args = p.parse_args(argv)
    args.bench_argv = argv
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
