"""The ragged kernel on prefill chunks alone: device time of block variants, interleaved.

The mixed-step bench (bench/mixed_attention.py) times the chunk's ragged kernel by the host
clock, once per variant: the same blocks read 263 and 344 us in one call
(history/mixed_attention.json), so its sweeps could not rank variants. Here every variant is
timed by the profiler's device time (bench.profile.device_seconds) in several rounds, the
variants interleaved in each round, and the median kept. One layer, Llama-3-8B heads (Hq 32,
Hkv 8, D 128, page 16), KV pages in a random order. Cases:

  first   one sequence's first chunk, 1793 tokens at positions 0..1792 (the mixed bench's)
  pair    a chunk like the throughput run's (1000-token prompts, ~1560 chunk tokens beside
          ~488 decode rows): one prompt's last 560 tokens (positions 440..999, its first 440
          cached) and the next prompt's first 1000
  long256 the last 256-token chunk (the engine's default budget) of an 8,000-token prompt
  hit50   50 new tokens after a 4,000-token cached prefix (a prefix-cache hit)

    OUT=dir python -m bench.probes.ragged_prefill [--variants V;V..] [--cases first,pair]
        [--kv fp8,bf16] [--rounds 5] [--calls 10] [--once]

A variant is "block_q,block_tokens,warps,stages,fp8_compute[,prefetch[,heavy_first]]"
(tuning.parse_ragged) or "tuned" (the table's entry, num_splits by tuning.ragged_splits for
the case), either with an optional "/S": S splits of the context. --once runs each
variant's kernel three times and exits (for Nsight Compute: `ncu -k regex:ragged
--launch-skip 2 --launch-count 1 ...`). TFLOP/s counts the causal work only: 4 * D * Hq per
(token, visible key) pair. `max_abs_err`: the largest difference from the plain-jnp
reference (f32) over the outputs (the kernel's are in q's dtype, bf16). On the CPU it runs
a small case in interpret mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import jax
import jax.numpy as jnp

from bench.kernels import D, HKV, HQ, PAGE
from bench.mixed_attention import make_chunks
from bench.probes import interleaved_us, write_probe
from pallas_kernels import tuning
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention_blocks,
                                                   ragged_paged_attention_reference)

GPU = jax.default_backend() == "gpu"
CASES = {"first": ((0, 1793),), "pair": ((440, 560), (0, 1000)),
         "long256": ((7744, 256),), "hit50": ((4000, 50),)} if GPU else {
    "first": ((0, 40),), "pair": ((8, 12), (0, 20)), "long256": ((40, 8),),
    "hit50": ((36, 5),)}


def make_case(seqs, fp8: bool, key, static: bool = False):
    """seqs: (cached tokens, new tokens) per sequence -> q [T, HQ, D], (k, v, ks, vs; FP8
    scales per token or `static`), AttentionMetadata (bench.mixed_attention.make_chunks), and
    the causal (token, key) pair count."""
    q, cache, md = make_chunks(seqs, fp8, key, static)
    return q, cache, md, sum(c + i + 1 for c, n in seqs for i in range(n))


def blocks_of(text: str, fp8: bool, md) -> tuning.RaggedBlocks:
    """A variant's blocks: "tuned" is the table's entry with the split rule for the case's
    tokens and context (md); a "/S" suffix sets num_splits = S."""
    text, _, splits = text.partition("/")
    if text == "tuned":
        blk = tuning.ragged_blocks(1 if fp8 else 2, D, PAGE, md.positions.shape[0], HKV,
                                   md.page_table.shape[1] * PAGE)
    else:
        blk = tuning.RaggedBlocks(*tuning.parse_ragged(text))
    return dataclasses.replace(blk, num_splits=int(splits)) if splits else blk


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="tuned",
                    help="';'-separated variants (module docstring); default: tuned")
    ap.add_argument("--cases", default="first,pair")
    ap.add_argument("--kv", default="fp8,bf16",
                    help="KV forms: fp8 (per-token scales), fp8s (static scales), bf16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="calls per timed batch")
    ap.add_argument("--once", action="store_true", help="three calls per variant, no timing")
    ap.add_argument("--out", default=None, help="JSON file (default $OUT/ragged_prefill.json)")
    ap.add_argument("--git", default=None,
                    help="git sha to record (default: git rev-parse HEAD; the GPU machine's "
                         "copy of the tree may carry an older .git)")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(";") if v]
    scale = D ** -0.5
    rows = []
    for kv in args.kv.split(","):
        if kv not in ("fp8", "fp8s", "bf16"):
            raise SystemExit(f"--kv: {kv!r} is not one of fp8, fp8s, bf16")
        fp8 = kv != "bf16"
        for case in args.cases.split(","):
            q, (k, v, ks, vs), md, pairs = make_case(CASES[case], fp8, jax.random.PRNGKey(0),
                                                     static=kv == "fp8s")
            flops = 4 * D * HQ * pairs
            fns = {}
            for text in variants:
                blk = blocks_of(text, fp8, md)
                fns[text] = jax.jit(lambda q, md, k, v, ks, vs, blk=blk:
                                    ragged_paged_attention_blocks(
                                        q, k, v, 0, md, ks, vs, sm_scale=scale, blocks=blk,
                                        interpret=not GPU))
            ref = ragged_paged_attention_reference(q, k, v, 0, md, ks, vs, sm_scale=scale)
            ref = ref.astype(jnp.float32)
            err = {t: float(jnp.max(jnp.abs(fn(q, md, k, v, ks, vs).astype(jnp.float32) - ref)))
                   for t, fn in fns.items()}
            if args.once:
                for text, fn in fns.items():
                    for _ in range(3):
                        jax.block_until_ready(fn(q, md, k, v, ks, vs))
                    print(f"{kv} {case} {text}: 3 calls", flush=True)
                continue
            samples = interleaved_us(
                {t: (lambda fn=fn: [fn(q, md, k, v, ks, vs) for _ in range(args.calls)],
                     args.calls) for t, fn in fns.items()}, args.rounds)
            for text in fns:
                us = statistics.median(samples[text]) if samples[text] else None
                rows.append(dict(kv_dtype=kv, case=case, tokens=int(q.shape[0]),
                                 variant=text, blocks=str(blocks_of(text, fp8, md)),
                                 us_device=round(us, 1) if us else None,
                                 us_rounds=[round(x, 1) for x in samples[text]],
                                 max_abs_err=round(err[text], 5),
                                 tflops=round(flops / us / 1e6, 1) if us else None))
                print(rows[-1], flush=True)
    if not args.once:
        write_probe(args.out or os.path.join(os.environ.get("OUT", "."), "ragged_prefill.json"),
                    "ragged_prefill", args.git, argv, rows)


if __name__ == "__main__":
    main()
