"""`jaxinfer` command line: generate, convert, serve, client, bench.

Only this module reads argv/env; everything below it takes frozen config objects.
"""
from __future__ import annotations

import argparse
import sys

from bench.cli import add_bench_arguments, run_bench
from checkpoints.calibrate import DEFAULT_WINDOWS
from checkpoints.convert import convert
from jaxinfer.args import (add_distributed_args, add_engine_args, add_sampling_args,
                           engine_config_from_args, run_in_job, sampling_params_from_args)
from jaxinfer.batch_generate import run_batch_file
from jaxinfer.config import WEIGHT_FORMATS
from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM
from serve.cli import add_client_arguments, add_serve_arguments, run_client, run_serve

class HELP(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default, except where the help text says it already
    ("default: ...") and for flags (a store_true default is always False)."""

    def _get_help_string(self, action):
        if "default:" in (action.help or "") or isinstance(
                action, (argparse._StoreTrueAction, argparse._StoreConstAction)):
            return action.help
        return super()._get_help_string(action)


def cmd_generate(args) -> int:
    if args.input or args.output:
        return run_batch_file(args)
    if args.prompt is None:
        raise JaxinferError("give a PROMPT, or --input prompts.jsonl --output out.jsonl")
    params = sampling_params_from_args(args)   # bad flags fail before the model loads
    llm = LLM(args.model, engine_config=engine_config_from_args(args), lora_modules=args.lora)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    print((args.prompt if not args.chat else "") + out.text)
    return 0


def cmd_convert(args) -> int:
    convert(args.src, args.dst, weights=args.weights, calibrate=args.calibrate,
            calibration_windows=args.calibration_windows, progress=True,
            lm_head=args.lm_head)
    print(f"wrote {args.dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxinfer", formatter_class=HELP,
        description="JAX/XLA inference runtime for Llama-family LLMs. Runs on the CPU or an "
                    "NVIDIA GPU; with no --model it uses the embedded SmolLM2-135M-Instruct.")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str, description: str, func):
        parser = sub.add_parser(name, help=summary, description=description,
                                formatter_class=HELP)
        parser.set_defaults(func=func)
        return parser

    g = command("generate", "complete a prompt, or a JSONL file of prompts",
                "Complete PROMPT and print it, or run a JSONL batch (--input/--output) with a "
                "progress bar and a summary.", cmd_generate)
    g.add_argument("prompt", nargs="?", help="prompt text")
    g.add_argument("--chat", action="store_true",
                   help="wrap PROMPT as a user message in the model's chat template")
    g.add_argument("--input", help="JSONL of requests, each line {prompt|messages|"
                                   "prompt_token_ids, [id], [sampling fields]} or an OpenAI "
                                   "batch line {custom_id, method: POST, url: /v1/completions|"
                                   "/v1/chat/completions, body}")
    g.add_argument("--output", help="JSONL results, appended as each request finishes (OpenAI "
                                    "batch output lines for batch lines); re-running skips ids "
                                    "and custom_ids already there")
    add_engine_args(g)
    add_distributed_args(g)
    add_sampling_args(g)

    c = command("convert", "convert a checkpoint to the fast-loading orbax form",
                "Load SRC (.gguf, HF dir, or 'smollm2') and write DST as an orbax checkpoint "
                "(+ config and tokenizer) that loads fast.", cmd_convert)
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="store linear weights as-is or quantized to FP8 e4m3")
    c.add_argument("--calibrate", action="store_true",
                   help="with --weights fp8: round each weight knowing its inputs (GPTQ-style "
                        "error compensation over calibration text): same format and speed, "
                        "closer to bf16")
    c.add_argument("--calibration-windows", type=int, default=DEFAULT_WINDOWS, metavar="N",
                   help="calibration sequences of 512 tokens (more: closer to bf16, a longer "
                        "conversion)")
    c.add_argument("--lm-head", choices=("bf16", "int8"), default="bf16",
                   help="store the LM head as-is or as int8 codes per vocab row (load it "
                        "with --lm-head int8); with --calibrate rounded the same way as the "
                        "FP8 layers")

    add_serve_arguments(command(
        "serve", "serve a model over gRPC (streaming, health, reflection, metrics)",
        "Serve --model over gRPC (jaxinfer.v1.Inference, grpc.health.v1, reflection); "
        "Prometheus metrics on --metrics-port.", run_serve))
    add_client_arguments(command(
        "client", "stream a completion from a jaxinfer server",
        "Send PROMPT to a jaxinfer server and stream the answer.", run_client))
    add_bench_arguments(command(
        "bench", "benchmark suites (compile, decode, paged_attention, throughput, serving, ...)",
        "Run a benchmark suite; its JSON result goes outside the tree unless --out names a "
        "path.", run_bench))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "coordinator_address"):     # generate, serve: may run as a job
            return run_in_job(args, args.func)
        return args.func(args)
    except JaxinferError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
