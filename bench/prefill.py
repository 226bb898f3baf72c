"""`jaxinfer bench prefill`: time to first token vs prompt length, and bucket padding waste.

One request at a time through the real Engine (scheduler, buckets, chunked prefill, sampling)
with max_tokens=1: TTFT = wall time from add_request to its first token. Each prompt length
runs once untimed (compiling the buckets it passes through), then `--reps` (at most 5) times
on fresh random prompts, median. Prefix caching is off so no run reuses another's pages.
Padding waste = padded tokens computed / all tokens computed over that prompt's steps.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from bench.common import new_result, print_table, progress, save, weights_name
from jaxinfer.request import SamplingParams

KEYS = ["prompt_len", "ttft_ms", "steps", "padding_fraction", "prefill_tokens_per_s",
        "achieved_TFLOPs"]


def first_token_s(engine, ids: list[int]) -> tuple[float, int]:
    """(seconds to the first token, engine steps taken) for one prompt."""
    t0 = time.perf_counter()
    engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    first = engine.num_steps
    while True:   # with async scheduling the token arrives one step() call later
        if engine.step():
            return time.perf_counter() - t0, engine.num_steps - first


def prefill_flops(cfg, n: int) -> int:
    matmul_params = cfg.param_count() - (0 if cfg.tie_word_embeddings
                                         else cfg.vocab_size * cfg.hidden_size)
    causal_pairs = n * (n + 1) // 2
    return 2 * matmul_params * n + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * \
        causal_pairs


def measure(engine, n: int, reps: int, rng) -> dict:
    vocab = engine.model_config.vocab_size
    prompt = lambda: rng.integers(3, vocab, n).tolist()  # noqa: E731
    first_token_s(engine, prompt())
    buckets = engine.buckets
    real0, padded0 = buckets.real_tokens, buckets.padded_tokens
    runs = [first_token_s(engine, prompt()) for _ in range(max(1, min(reps, 5)))]
    ttft = statistics.median(t for t, _ in runs)
    padded = buckets.padded_tokens - padded0
    return {"prompt_len": n, "ttft_ms": round(ttft * 1e3, 3), "steps": runs[0][1],
            "padding_fraction": round(1 - (buckets.real_tokens - real0) / padded, 4),
            "prefill_tokens_per_s": round(n / ttft, 1),
            "achieved_TFLOPs": round(prefill_flops(engine.model_config, n) / ttft / 1e12, 4)}


def run(args) -> int:
    from jaxinfer.cli import engine_config_from_args
    from jaxinfer.engine import Engine

    lengths = args.contexts
    engine_cfg = engine_config_from_args(args).replace(
        enable_prefix_caching=False, max_num_seqs=max(args.batch_sizes),
        max_model_len=max(args.max_model_len, max(lengths) + 1))
    engine = Engine.from_model(args.model, engine_cfg)
    result = new_result("prefill", args.git, model=args.model,
                        weights=weights_name(engine_cfg),
                        max_num_batched_tokens=engine_cfg.max_num_batched_tokens)
    rng = np.random.default_rng(0)
    for n in progress(lengths, "prefill lengths"):
        save(result, args.out, [measure(engine, n, args.reps, rng)])
    print_table(result["rows"], KEYS)
    return 0
