"""The engine and sampling flags shared by every command line (`jaxinfer generate`, `serve`,
`bench`): argparse groups and the frozen configs they describe."""
from __future__ import annotations

import argparse

from jaxinfer.config import (ATTENTION_IMPLS, DTYPES, KV_DTYPES, KV_SCALES, LM_HEADS,
                             SPECULATIVE_METHODS, STANDARD_CONFIGS_DIR, WEIGHT_FORMATS,
                             EngineConfig)
from jaxinfer.request import SamplingParams

DEFAULT_MODEL = "smollm2"
DEFAULT_MAX_LORAS = 4    # device adapter slots when --lora is given without --max-loras


def add_engine_args(p: argparse.ArgumentParser):
    shapes = ", ".join(sorted(f.stem for f in STANDARD_CONFIGS_DIR.glob("*.json")))
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="'smollm2' (the embedded default), a .gguf file, an HF directory "
                        "(config.json + *.safetensors), a Hugging Face id (org/name) in the "
                        "local Hugging Face cache, an orbax directory written by "
                        f"`jaxinfer convert`, or a standard shape with synthetic weights "
                        f"({shapes})")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="compute dtype (auto: bfloat16 on a GPU, float32 elsewhere)")
    g.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                   help="linear weight format: as loaded, or FP8 e4m3 with per-channel scales")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="KV cache dtype (auto = compute dtype)")
    g.add_argument("--lm-head", choices=LM_HEADS, default="bf16",
                   help="LM head: as loaded, int8 codes with a scale per vocab row (half the "
                        "bytes; for small batches), or auto (int8 for steps of up to 64 rows, "
                        "a bf16 copy of it for larger ones)")
    g.add_argument("--kv-scales", choices=KV_SCALES, default="static",
                   help="FP8 KV scales: one per layer and kv head calibrated at start-up, "
                        "or one per token and kv head")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--max-model-len", type=int, default=2048,
                   help="longest sequence (prompt + output) served")
    g.add_argument("--max-num-seqs", type=int, default=32, help="rows per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="token budget per step (decode tokens + prefill chunks)")
    g.add_argument("--num-pages", type=int, default=0,
                   help="KV pages in the pool (0: enough for max-num-seqs full sequences)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--itl-target-ms", type=float, default=0.0,
                   help="keep steps that carry decode rows under this many milliseconds "
                        "(predicted from the steps timed so far) by giving prefills fewer "
                        "tokens a step (0: off)")
    g.add_argument("--attention", choices=ATTENTION_IMPLS, default="auto",
                   help="attention implementation (auto: Pallas on GPU, jnp reference on CPU)")
    g.add_argument("--tensor-parallel", type=int, default=1, help="GPUs to shard the model over")
    g.add_argument("--layer-loop", choices=("auto", "scan", "unroll"), default="auto",
                   help="decoder layers as lax.scan over stacked weights, or unrolled with one "
                        "weight buffer per layer (auto: unrolled on a GPU, scanned elsewhere)")
    g.add_argument("--unroll-layers", dest="layer_loop", action="store_const", const="unroll",
                   help="same as --layer-loop unroll")
    g.add_argument("--compile-cache-dir", default="auto", metavar="DIR",
                   help="JAX's persistent compilation cache: a restart loads the compiled "
                        "steps instead of compiling them (auto: JAX_COMPILATION_CACHE_DIR, "
                        "else ~/.cache/jaxinfer/xla)")
    g.add_argument("--no-compile-cache", action="store_true",
                   help="compile everything afresh and keep nothing on disk")
    g.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                   help="compile every bucket before the first request, so none compiles "
                        "later (auto: on a GPU, and always for `jaxinfer serve`)")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before preparing the next (otherwise the "
                        "host prepares step t+1 while step t runs)")
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--lora", action="append", type=lora_module, default=[],
                   metavar="NAME=PATH",
                   help="serve the PEFT adapter in directory PATH as NAME (repeatable; "
                        "requests name it as their model or SamplingParams.lora)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="adapters on the device at once (default: 4 with --lora, else 0: "
                        "LoRA off; the servers' runtime loading needs it above 0)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (<= 64)")
    g.add_argument("--max-cpu-loras", type=int, default=0,
                   help="adapters kept in host memory (0: --max-loras)")
    d = EngineConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="tokens proposed per row and step, all verified in one forward pass "
                        "(0: off); outputs keep the model's distribution, greedy ones are "
                        "identical")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                   default=d.speculative_method,
                   help="the proposer: ngram (prompt lookup: what followed the latest earlier "
                        "occurrence of the context's last tokens), self (the model's own "
                        "first layers draft on the device) or draft (--speculative-model "
                        "drafts)")
    g.add_argument("--prompt-lookup-min", type=int, default=d.prompt_lookup_min,
                   help="shortest suffix the ngram proposer matches")
    g.add_argument("--prompt-lookup-max", type=int, default=d.prompt_lookup_max,
                   help="longest suffix the ngram proposer matches (tried first)")
    g.add_argument("--speculative-draft-layers", type=int, default=d.speculative_draft_layers,
                   help="layers self-speculation drafts with (0: half the model's)")
    g.add_argument("--speculative-model", default="", metavar="MODEL",
                   help="the draft model of --speculative-method draft (any --model source "
                        "with the same vocabulary)")
    g.add_argument("--speculative-disable-batch-size", type=int,
                   default=d.speculative_disable_batch_size,
                   help="steps with more running requests than this do not speculate")


def add_distributed_args(p: argparse.ArgumentParser):
    g = p.add_argument_group(
        "several processes", "one model over several processes (hosts), JAX's "
        "multi-controller runtime: run the same command in every process; process 0 "
        "serves, the others follow it. Set --tensor-parallel to the devices of all of them")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's coordination service")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the job")
    g.add_argument("--process-id", type=int, default=None, help="this process's number")
    g.add_argument("--distributed", action="store_true",
                   help="join a job whose settings JAX detects (SLURM, Open MPI, ...)")
    g.add_argument("--heartbeat-timeout", type=int, default=30, metavar="S",
                   help="a process silent this long is declared dead and the job ends (the "
                        "leader acts on a silent follower after half of it)")


def distributed_from_args(args):
    """multihost.DistributedConfig of the flags (add_distributed_args), None: one process."""
    given = (args.coordinator_address, args.num_processes, args.process_id)
    if not args.distributed and all(v is None for v in given):
        return None
    from jaxinfer.multihost import DistributedConfig
    return DistributedConfig(*given, heartbeat_timeout_s=args.heartbeat_timeout)


def run_in_job(args, func) -> int:
    """func(args) here; in a job of several processes (add_distributed_args) on process 0
    only, while every other process follows it (multihost.py)."""
    distributed = distributed_from_args(args)
    if distributed is not None:
        from jaxinfer import multihost
        if not multihost.join(distributed):
            from jaxinfer.follower import follow_model
            return follow_model(args.model, engine_config_from_args(args))
    return func(args)


def engine_config_from_args(args) -> EngineConfig:
    """The EngineConfig the engine flags (add_engine_args) describe."""
    return EngineConfig(
        page_size=args.page_size, num_pages=args.num_pages, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype, kv_scales=args.kv_scales,
        lm_head=args.lm_head,
        attention_impl=args.attention, enable_prefix_caching=not args.no_prefix_caching,
        itl_target_ms=args.itl_target_ms,
        tensor_parallel=args.tensor_parallel,
        unroll_layers={"auto": None, "scan": False, "unroll": True}[args.layer_loop],
        async_scheduling=not args.no_async_scheduling,
        compile_cache="off" if args.no_compile_cache else args.compile_cache_dir,
        warmup={"auto": None, "on": True, "off": False}[args.warmup],
        max_loras=(args.max_loras if args.max_loras is not None
                   else DEFAULT_MAX_LORAS if args.lora else 0),
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_method=args.speculative_method, prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        speculative_draft_layers=args.speculative_draft_layers,
        speculative_model=args.speculative_model,
        speculative_disable_batch_size=args.speculative_disable_batch_size)


def engine_argv(args) -> list[str]:
    """The engine flags (add_engine_args) of the parsed `args` as argv, for a child process
    to parse back into the same EngineConfig; flags at their defaults are left out."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    defaults, argv, seen = p.parse_args([]), [], set()
    for action in p._actions:
        dest = action.dest
        if dest in seen:            # an alias (--unroll-layers): the first flag says it
            continue
        seen.add(dest)
        value, flag = getattr(args, dest), action.option_strings[0]
        if value == getattr(defaults, dest):
            continue
        if action.nargs == 0:       # store_true / store_const
            argv.append(flag)
        elif isinstance(value, list):   # repeatable (--lora NAME=PATH)
            for v in value:
                argv += [flag, "=".join(v) if isinstance(v, tuple) else str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def lora_module(text: str) -> tuple[str, str]:
    """--lora's NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter's name and its "
                                         f"PEFT directory), got {text!r}")
    return name.strip(), path.strip()


def add_sampling_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p_max")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--use-lora", default=None, metavar="NAME",
                   help="answer with this LoRA adapter (one of --lora's); default: the base "
                        "model")


def sampling_params_from_args(args) -> SamplingParams:
    """The SamplingParams the sampling flags (add_sampling_args) describe."""
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          stop=tuple(args.stop), lora=args.use_lora)
