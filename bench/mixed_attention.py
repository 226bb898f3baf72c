"""One mixed step's attention (`python -m bench.kernels --mixed`): 255 decode rows at
1000-2000 tokens plus one sequence's 1793-token prefill chunk, one layer, bf16 and FP8 KV. What
the engine's prefill-carrying steps run: the decode rows through the decode kernel and the
chunk through the ragged kernel (`ragged_public`), against the ragged kernel over every row
and other block sizes for either part. Timing as bench/kernels.py's (same process, medians).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bench.kernels import D, HKV, HQ, PAGE, timed
from jaxinfer.kv_cache import FP8_DTYPE, AttentionMetadata
from pallas_kernels import tuning
from pallas_kernels.paged_attention import paged_attention, paged_attention_blocks
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_blocks)


def make_chunks(seqs, fp8: bool, key, static: bool = False):
    """seqs: (cached tokens, new tokens) per sequence -> q [T, HQ, D], the cache (k, v, ks,
    vs; one layer, pages in a random order; FP8 scales per token, or with `static` one per
    kv head [1, K]) and AttentionMetadata, T = all new tokens."""
    ks = jax.random.split(key, 8)
    lens = [c + n for c, n in seqs]
    pps = -(-max(lens) // PAGE)
    pages = 1 + sum(-(-n // PAGE) for n in lens)
    perm = (1 + jax.random.permutation(ks[1], pages - 1)).tolist()
    table, at = [], 0
    for n in lens:
        need = -(-n // PAGE)
        table.append(perm[at:at + need] + [0] * (pps - need))
        at += need
    positions = [p for c, n in seqs for p in range(c, c + n)]
    token_seq = [b for b, (_, n) in enumerate(seqs) for _ in range(n)]
    slots = [table[b][p // PAGE] * PAGE + p % PAGE for b, p in zip(token_seq, positions)]
    start = [0]
    for _, n in seqs:
        start.append(start[-1] + n)
    md = AttentionMetadata(*(jnp.asarray(x, jnp.int32) for x in
                             (positions, slots, token_seq, table, lens, start)))
    shape = (1, HKV, pages, PAGE, D)
    dt = FP8_DTYPE if fp8 else jnp.bfloat16
    k = jax.random.normal(ks[2], shape, jnp.bfloat16).astype(dt)
    v = jax.random.normal(ks[3], shape, jnp.bfloat16).astype(dt)
    scale_shape = shape[:2] if static else shape[:-1]
    scales = ([jax.random.uniform(x, scale_shape, jnp.float32, 0.5, 1.5) / 16 for x in ks[4:6]]
              if fp8 else [None, None])
    q = jax.random.normal(ks[6], (len(positions), HQ, D), jnp.bfloat16)
    return q, (k, v, *scales), md


def make_mixed(decode_rows: int, prefill: int, fp8: bool, key, context=(1000, 2000)):
    """A mixed step: `decode_rows` sequences with one new token each at contexts drawn from
    `context`, then one sequence's first prefill chunk of `prefill` tokens (causal over
    itself). Returns make_chunks' q, cache and metadata, T = decode_rows + prefill."""
    lens = jax.random.randint(jax.random.split(key, 8)[0], (decode_rows,), *context).tolist()
    return make_chunks([(n - 1, 1) for n in lens] + [(0, prefill)], fp8, key)


# the ragged kernel over every row of the step, with these RaggedBlocks(block_q, block_tokens,
# warps, stages, fp8_compute); None = the tuned table's
RAGGED_VARIANTS = (("tuned", None),)
# the ragged kernel over the prefill row alone (what it runs in the engine now), as
# "block_q,block_tokens,warps,stages,fp8_compute[,prefetch]" (fp8_compute only matters for
# FP8 KV; prefetch: RaggedBlocks.prefetch_table)
PREFILL_VARIANTS = ("16,64,4,2,bfloat16", "16,64,4,3,bfloat16,1", "32,64,4,3,bfloat16,1",
                    "32,32,4,3,bfloat16,1", "64,32,8,3,bfloat16,1", "32,64,8,3,bfloat16,1",
                    "16,64,4,3,f16pairs,1", "32,64,8,3,f16pairs,1")


# the decode rows alone under other DecodeBlocks (block_tokens, warps, stages, fp8_compute,
# prefetch_table), per KV dtype: the tables before page-table prefetch
DECODE_VARIANTS = {"fp8": ((128, 4, 2, "f16pairs", False),),
                   "bf16": ((64, 4, 3, "bfloat16", False),)}


def bench_mixed(key, decode_rows: int = 255, prefill: int = 1793,
                variants=RAGGED_VARIANTS, prefill_variants=PREFILL_VARIANTS) -> list[dict]:
    """The attention of one mixed step (what the engine's prefill-carrying steps run), one
    layer: `ragged_public` (the public entry: decode rows through the decode kernel, the
    prefill row through the ragged kernel, `split_decode` + `split_prefill` alone),
    `ragged_all_<variant>`: the ragged kernel over every row (the route before the split),
    and `split_decode@<blocks>` / `split_prefill@<blocks>`: the decode rows / the prefill
    row alone under other block sizes."""
    scale = D ** -0.5
    rows = []
    for fp8 in (False, True):
        q, (k, v, ks, vs), md = make_mixed(decode_rows, prefill, fp8, key)
        base = {"kv_dtype": "fp8" if fp8 else "bf16", "batch": decode_rows + 1,
                "tokens": int(q.shape[0]), "decode_rows": decode_rows, "prefill": prefill}
        # the cache travels as arguments: closed over, jit would embed it as a constant
        fns = {"ragged_public": lambda q, md, k, v, ks, vs: ragged_paged_attention(
            q, k, v, 0, md, ks, vs, sm_scale=scale)}
        for label, fields in variants:
            blk = (tuning.ragged_blocks(1 if fp8 else 2, D, PAGE) if fields is None
                   else tuning.RaggedBlocks(*fields))
            fns["ragged_all_" + label] = functools.partial(
                lambda q, md, k, v, ks, vs, blk: ragged_paged_attention_blocks(
                    q, k, v, 0, md, ks, vs, sm_scale=scale, blocks=blk), blk=blk)
        fns["split_decode"] = lambda q, md, k, v, ks, vs: paged_attention(
            q[:decode_rows], k, v, 0, md.seq_lens[:decode_rows],
            md.page_table[:decode_rows], ks, vs, sm_scale=scale)
        fns["split_prefill"] = lambda q, md, k, v, ks, vs: ragged_paged_attention_blocks(
            q, k, v, 0, md, ks, vs, sm_scale=scale, skip_single=True,
            blocks=tuning.ragged_blocks(1 if fp8 else 2, D, PAGE))
        for tok, warps, stages, comp, pre in DECODE_VARIANTS[base["kv_dtype"]]:
            fns[f"split_decode@{tok},{warps},{stages},{comp},{int(pre)}"] = functools.partial(
                lambda q, md, k, v, ks, vs, blk: paged_attention_blocks(
                    q[:decode_rows], k, v, 0, md.seq_lens[:decode_rows],
                    md.page_table[:decode_rows], ks, vs, sm_scale=scale, blocks=blk),
                blk=tuning.DecodeBlocks(tok, 1, warps, stages, comp, pre))
        for text in prefill_variants:
            if not fp8 and tuning.parse_ragged(text)[4] != "bfloat16":
                continue          # the FP8 widening choices are the same kernel on bf16 KV
            fns["split_prefill@" + text] = functools.partial(
                lambda q, md, k, v, ks, vs, blk: ragged_paged_attention_blocks(
                    q, k, v, 0, md, ks, vs, sm_scale=scale, skip_single=True, blocks=blk),
                blk=tuning.RaggedBlocks(*tuning.parse_ragged(text)))
        for name, fn in fns.items():
            try:
                sec = timed(jax.jit(fn), (q, md, k, v, ks, vs))
                rows.append({"impl": name, **base, "us": round(sec * 1e6, 2)})
            except Exception as e:
                rows.append({"impl": name, **base, "error": f"{type(e).__name__}: {e}"[:300]})
            print(rows[-1], flush=True)
    return rows
