"""Prefill chunks' attention through cuDNN's flash attention, against the ragged kernel.

The ragged Pallas kernel runs a throughput-run prefill chunk at ~100-110 TFLOP/s
(bench/probes/ragged_prefill.py), a tenth of the H200's bf16 tensor-core rate. cuDNN's fused
attention (`jax.nn.dot_product_attention(implementation="cudnn")`) is the library route the
paged-attention issue allows ("gather + fused attention"). Its causal mask is aligned top-left
(query i sees keys 0..i), right only where a row's chunk starts at position 0, so a chunk with
a cached prefix is two calls merged by their log-sum-exp:

  part A  the chunk's queries against the row's cached prefix (gathered from the pages and
          widened to bf16): no causal mask, key length = the prefix
  part B  the chunk's queries against the chunk's own keys: causal, T == S, top-left is right

Rows are padded to [B, T, ...] (B rows, T = the longest chunk or --pad-tokens) with their
lengths passed as query/key sequence lengths. A row without a prefix gets a one-key part A
whose log-sum-exp is masked to -inf. Here part B's keys are gathered from the cache too (in a
model they would be the step's fresh K/V, before the cache write).

Timed by device time (bench.profile.device_seconds), variants interleaved over rounds, the
median kept; each row also gives the route's kernels by name from the last round's trace.
Cases as bench/probes/ragged_prefill.py's. On the CPU it checks the route against the
reference with implementation="xla" on small cases (no timing).

    OUT=dir python -m bench.probes.cudnn_prefill [--cases first,pair] [--kv fp8,bf16]
        [--pad-tokens 0] [--rounds 5] [--calls 10] [--git SHA]
"""
from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp

from bench.kernels import D, HQ, PAGE
from bench.probes import interleaved_us, write_probe
from bench.probes.ragged_prefill import CASES, blocks_of, make_case
from bench.profile import device_events, summarize, trace_events
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention_blocks,
                                                   ragged_paged_attention_reference)

GPU = jax.default_backend() == "gpu"


def gather_rows(cache_k, scales, page_table, start, length, width):
    """Keys (or values) of positions start[b] .. start[b] + width - 1 of every row from one
    layer's pages [1, HKV, P, PAGE, D] -> [B, width, HKV, D] bf16 (FP8 times its per token-head
    scale); positions past length[b] read page 0 and are masked by the caller."""
    pos = start[:, None] + jnp.arange(width)[None, :]                      # [B, W]
    valid = jnp.arange(width)[None, :] < length[:, None]
    pos = jnp.where(valid, pos, 0)
    page = jnp.take_along_axis(page_table, pos // PAGE, axis=1)            # [B, W]
    slot = pos % PAGE
    x = cache_k[0][:, page, slot]                                          # [HKV, B, W, D]
    x = x.astype(jnp.float32)
    if scales is not None:
        x = x * scales[0][:, page, slot][..., None]
    return jnp.transpose(x, (1, 2, 0, 3)).astype(jnp.bfloat16)


def cudnn_route(q, k, v, ks, vs, md, *, rows: int, width: int, prefix_width: int,
                implementation: str, sm_scale: float):
    """Attention of every new token in md (rows of > 0 new tokens) by the two-part route of the
    module docstring. q [T, HQ, D] flat as AttentionMetadata lays it out -> [T, HQ, D]."""
    qlen = md.query_start[1:rows + 1] - md.query_start[:rows]             # [B]
    prefix = md.seq_lens[:rows] - qlen
    idx = md.query_start[:rows, None] + jnp.arange(width)[None, :]        # [B, W]
    qmask = jnp.arange(width)[None, :] < qlen[:, None]
    qp = q[jnp.where(qmask, idx, 0)]                                       # [B, W, HQ, D]
    zero = jnp.zeros_like(prefix)
    kb = gather_rows(k, ks, md.page_table, prefix, qlen, width)
    vb = gather_rows(v, vs, md.page_table, prefix, qlen, width)
    ka = gather_rows(k, ks, md.page_table, zero, prefix, prefix_width)
    va = gather_rows(v, vs, md.page_table, zero, prefix, prefix_width)
    ob, lb = jax.nn.dot_product_attention(
        qp, kb, vb, scale=sm_scale, is_causal=True, query_seq_lengths=qlen,
        key_value_seq_lengths=qlen, implementation=implementation, return_residual=True)
    oa, la = jax.nn.dot_product_attention(
        qp, ka, va, scale=sm_scale, query_seq_lengths=qlen,
        key_value_seq_lengths=jnp.maximum(prefix, 1), implementation=implementation,
        return_residual=True)
    la = jnp.where(prefix[:, None, None] > 0, la.astype(jnp.float32), -jnp.inf)
    lb = lb.astype(jnp.float32)
    m = jnp.maximum(la, lb)
    wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
    out = ((oa.astype(jnp.float32) * wa[..., None] + ob.astype(jnp.float32) * wb[..., None])
           / (wa + wb)[..., None]).astype(q.dtype)                          # [B, W, HQ, D]
    # back to the flat layout: token t of row b is out[b, t - query_start[b]]
    t = jnp.arange(q.shape[0])
    b = md.token_seq
    return out[b, jnp.clip(t - md.query_start[b], 0, width - 1)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="first,pair")
    ap.add_argument("--kv", default="fp8,bf16")
    ap.add_argument("--pad-tokens", type=int, default=0,
                    help="pad every row's chunk to this many tokens (the bucket's; 0: the "
                         "longest chunk)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="calls per timed batch")
    ap.add_argument("--out", default=None, help="JSON file (default $OUT/cudnn_prefill.json)")
    ap.add_argument("--git", default=None, help="git sha to record (default: HEAD)")
    args = ap.parse_args(argv)
    impl = "cudnn" if GPU else "xla"
    scale = D ** -0.5
    rows = []
    for kv in args.kv.split(","):
        fp8 = kv == "fp8"
        for case in args.cases.split(","):
            seqs = CASES[case]
            q, (k, v, ks, vs), md, pairs = make_case(seqs, fp8, jax.random.PRNGKey(0))
            flops = 4 * D * HQ * pairs
            width = max(args.pad_tokens, max(n for _, n in seqs))
            pwidth = md.page_table.shape[1] * PAGE
            blk = blocks_of("tuned", fp8, md)
            fns = {
                "ragged_tuned": jax.jit(lambda q, md, k, v, ks, vs: ragged_paged_attention_blocks(
                    q, k, v, 0, md, ks, vs, sm_scale=scale, blocks=blk, interpret=not GPU)),
                "cudnn_route": jax.jit(lambda q, md, k, v, ks, vs: cudnn_route(
                    q, k, v, ks, vs, md, rows=len(seqs), width=width, prefix_width=pwidth,
                    implementation=impl, sm_scale=scale)),
            }
            ref = ragged_paged_attention_reference(q, k, v, 0, md, ks, vs, sm_scale=scale)
            ref = ref.astype(jnp.float32)
            err = {t: float(jnp.max(jnp.abs(fn(q, md, k, v, ks, vs).astype(jnp.float32) - ref)))
                   for t, fn in fns.items()}
            print(f"{kv} {case}: max_abs_err {err}", flush=True)
            if not GPU:
                continue
            samples = interleaved_us(
                {t: (lambda fn=fn: [fn(q, md, k, v, ks, vs) for _ in range(args.calls)],
                     args.calls) for t, fn in fns.items()}, args.rounds)
            for name, fn in fns.items():
                ev = device_events(trace_events(lambda fn=fn: jax.block_until_ready(
                    [fn(q, md, k, v, ks, vs) for _ in range(args.calls)])))
                top = summarize(ev, args.calls, top=12).get("top", [])
                us = statistics.median(samples[name])
                rows.append(dict(kv_dtype=kv, case=case, tokens=int(q.shape[0]), impl=name,
                                 pad_tokens=width, us_device=round(us, 1),
                                 us_rounds=[round(x, 1) for x in samples[name]],
                                 max_abs_err=round(err[name], 5),
                                 tflops=round(flops / us / 1e6, 1),
                                 kernels={t["name"]: round(t["ms_per_step"] * 1e3, 1)
                                          for t in top}))
                print(rows[-1], flush=True)
    if GPU:
        write_probe(args.out or os.path.join(os.environ.get("OUT", "."), "cudnn_prefill.json"),
                    "cudnn_prefill", args.git, argv, rows)


if __name__ == "__main__":
    main()
