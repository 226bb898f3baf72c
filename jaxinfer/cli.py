"""`jaxinfer` command line: generate, convert, serve, client, bench.

Only this module reads argv/env; everything below it takes frozen config objects.
"""
from __future__ import annotations

import argparse
import sys

from jaxinfer.config import LM_HEADS
from jaxinfer.errors import JaxinferError

DEFAULT_MODEL = "smollm2"


def add_engine_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="'smollm2' (the embedded default), a .gguf file, an HF directory "
                        "(config.json + *.safetensors), an orbax directory written by "
                        "`jaxinfer convert`, or a standard shape with synthetic weights "
                        "(llama-3-8b, qwen2.5-32b, smollm2-135m, tiny)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                   help="linear weight format: as loaded, or FP8 e4m3 with per-channel scales")
    g.add_argument("--kv-dtype", choices=("auto", "bf16", "fp8"), default="auto",
                   help="KV cache dtype (auto = compute dtype)")
    g.add_argument("--lm-head", choices=LM_HEADS, default="bf16",
                   help="LM head: as loaded, or int8 codes with a scale per vocab row (half "
                        "the bytes: a checkpoint's calibrated int8 head from `jaxinfer "
                        "convert --lm-head int8`, else rounded to nearest at load); for small "
                        "batches: above ~64 rows a step it is slower than bf16 on the H200. "
                        "auto: the int8 head's values, read as codes by steps of up to 64 "
                        "rows and from a bf16 copy of them by larger steps (the copy costs 2 "
                        "bytes per head weight)")
    g.add_argument("--kv-scales", choices=("static", "token"), default="static",
                   help="FP8 KV scales: static, one per layer and kv head calibrated at "
                        "start-up (faster attention), or one per token and kv head (nothing "
                        "to calibrate, no saturation)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest sequence (prompt + output) served")
    g.add_argument("--max-num-seqs", type=int, default=32, help="rows per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="token budget per step (decode tokens + prefill chunks)")
    g.add_argument("--num-pages", type=int, default=0,
                   help="KV pages in the pool (0: enough for max-num-seqs full sequences)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--attention", choices=("auto", "reference", "pallas"), default="auto",
                   help="attention implementation (auto: Pallas on GPU, jnp reference on CPU)")
    g.add_argument("--tensor-parallel", type=int, default=1, help="GPUs to shard the model over")
    g.add_argument("--layer-loop", choices=("auto", "scan", "unroll"), default="auto",
                   help="decoder layers as lax.scan over stacked weights, or unrolled with one "
                        "weight buffer per layer (faster decode on a GPU: no per-layer weight "
                        "copies; longer compiles). auto: unroll on a GPU, scan elsewhere")
    g.add_argument("--unroll-layers", dest="layer_loop", action="store_const", const="unroll",
                   help="same as --layer-loop unroll")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before preparing the next (default: the "
                        "host prepares step t+1 while step t runs)")


def engine_config_from_args(args):
    from jaxinfer.config import EngineConfig
    import jax

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    return EngineConfig(
        page_size=args.page_size, num_pages=args.num_pages, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=dtype, weights=args.weights, kv_dtype=args.kv_dtype, kv_scales=args.kv_scales,
        lm_head=args.lm_head,
        attention_impl=args.attention, enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel=args.tensor_parallel,
        unroll_layers={"auto": None, "scan": False, "unroll": True}[args.layer_loop],
        async_scheduling=not args.no_async_scheduling)


def add_sampling_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p_max")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params_from_args(args):
    from jaxinfer.request import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          stop=tuple(args.stop))


def cmd_generate(args) -> int:
    from jaxinfer.llm import LLM

    if args.input or args.output:
        from jaxinfer.batch_generate import run_batch_file
        return run_batch_file(args)
    if args.prompt is None:
        raise JaxinferError("give a PROMPT, or --input prompts.jsonl --output out.jsonl")
    params = sampling_params_from_args(args)   # bad flags fail before the model loads
    llm = LLM(args.model, engine_config=engine_config_from_args(args))
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    print((args.prompt if not args.chat else "") + out.text)
    return 0


def cmd_convert(args) -> int:
    from checkpoints.convert import convert

    convert(args.src, args.dst, weights=args.weights, calibrate=args.calibrate,
            calibration_windows=args.calibration_windows, progress=True,
            lm_head=args.lm_head)
    print(f"wrote {args.dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxinfer",
        description="JAX/XLA inference runtime for Llama-family LLMs. Runs on the CPU or an "
                    "NVIDIA GPU; with no --model it uses the embedded SmolLM2-135M-Instruct.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, or a JSONL file of prompts",
                       description="Complete PROMPT and print it, or run a JSONL batch "
                                   "(--input/--output) with a progress bar and a summary.")
    g.add_argument("prompt", nargs="?", help="prompt text")
    g.add_argument("--chat", action="store_true",
                   help="wrap PROMPT as a user message in the model's chat template")
    g.add_argument("--input", help="JSONL of requests: {prompt|messages|prompt_token_ids, [id], "
                                   "[sampling fields]}")
    g.add_argument("--output", help="JSONL results, appended as each request finishes; "
                                    "re-running skips ids already there")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a checkpoint to the fast-loading orbax form",
                       description="Load SRC (.gguf, HF dir, or 'smollm2') and write DST as an "
                                   "orbax checkpoint (+ config and tokenizer) that loads fast.")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                   help="store linear weights as-is or quantized to FP8 e4m3")
    c.add_argument("--calibrate", action="store_true",
                   help="with --weights fp8: round each weight knowing its inputs (GPTQ-style "
                        "error compensation over calibration text from Python's own "
                        "documentation strings): same format and speed, closer to bf16 "
                        "(SmolLM2 top-1 agreement 92.7%% -> 96.0%%); ~1 min on a CPU for "
                        "SmolLM2, far longer for billions of parameters")
    c.add_argument("--calibration-windows", type=int, default=None, metavar="N",
                   help="calibration sequences of 512 tokens (default 32: more windows, "
                        "closer to bf16, a longer conversion)")
    c.add_argument("--lm-head", choices=("bf16", "int8"), default="bf16",
                   help="store the LM head as-is or as int8 codes per vocab row (load it "
                        "with --lm-head int8); with --calibrate rounded the same way as the "
                        "FP8 layers")
    c.set_defaults(func=cmd_convert)

    from serve.cli import add_client_arguments, add_serve_arguments, run_client, run_serve
    s = sub.add_parser("serve", help="serve a model over gRPC (streaming, health, reflection, "
                                     "metrics)",
                       description="Serve --model over gRPC (jaxinfer.v1.Inference, "
                                   "grpc.health.v1, reflection); Prometheus metrics on "
                                   "--metrics-port.")
    add_serve_arguments(s)
    s.set_defaults(func=run_serve)
    cl = sub.add_parser("client", help="stream a completion from a jaxinfer server",
                        description="Send PROMPT to a jaxinfer server and stream the answer.")
    add_client_arguments(cl)
    cl.set_defaults(func=run_client)

    from bench.cli import add_bench_arguments, run_bench
    b = sub.add_parser("bench", help="benchmark suites: compile, decode, fusion, prefill",
                       description="Measure compile cost, decode roofline, kernel fusion and "
                                   "prefill latency; JSON results go to bench/results/.")
    add_bench_arguments(b)
    b.set_defaults(func=run_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except JaxinferError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
