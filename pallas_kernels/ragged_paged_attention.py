"""Ragged paged attention: queries of several tokens per sequence (chunked prefill, prefix-cache
hits, mixed steps) over the paged KV cache, causal within the chunk.

Token t attends to positions 0..positions[t] of sequence token_seq[t]; its own K/V are already
in the cache (kv_pages.write_kv runs first, a scatter of T*K*D elements). Cache
layout, FP8 scales, the FP8 compute dtype (RaggedBlocks.fp8_compute, same numerics) and the
block step are those of pallas_kernels/attention_block.py, shared with the decode kernel.

Kernel (Pallas Triton, like the decode kernel): grid (W, K, splits) over a work list. A
program takes `block_q` consecutive new tokens of one sequence and all G q heads of one kv head as
the rows of one tile (row r = token r // G', head r % G', G' = G rounded up to a power of
two; padding rows repeat a real token/head), so each page is read once per q block, not once
per token. KV steps below the block's smallest position run unmasked; the rest apply the
causal mask per row. Rows of padding tokens (never inside any query_start range) keep the
zeros the output starts from.

The work list (work_list below, a few XLA ops on [B] vectors) names the (sequence, q block)
of each program: sequence b has cdiv(q_len_b, block_q) blocks, so W = min(B * cdiv(T,
block_q), B + cdiv(T, block_q)) bounds the total for any split of T tokens over B rows;
entries past the real total exit at once. A dense grid (B, K, cdiv(T, block_q)) would be
almost all empty programs, each still scheduled on an SM (a mixed step of 256 rows and 2048
tokens: 262,144 programs per layer against W = 384). With blocks.heavy_first each row's q
blocks are listed last first: programs start in grid order, so the causally heaviest ones
(most KV blocks) start first and the grid's tail holds light ones, not idle SMs.

Split over the context (blocks.num_splits, tuning.ragged_splits): a chunk of T tokens is
cdiv(T, block_q) * K programs whatever its prefix, so a short chunk over a long context (the
engine's 256-token chunks of a long prompt, a prefix-cache hit) would run under one wave.
With S splits, program (w, h, s) takes the s-th of S equal runs of its q block's KV blocks
and writes its unnormalized accumulator and (max, sum); paged_attention's combine kernel
merges them, with a mask of the tokens some program covers (the others, padding and rows the
caller skips, come out zero). Split runs are empty past a q block's last KV block and weigh
nothing in the combine.

Why a kernel and not gather + dense attention: a gather materializes T x context x K x D, or
context per sequence plus a ragged-to-dense q regroup; this reads the pages in place with no
extra pass and shares the decode kernel's block step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kv_pages import FP8_DTYPE, is_static
from pallas_kernels import LOG2E, pow2_ceil, triton_params, tuning
from pallas_kernels.attention_block import (MIN_ROWS, attend_block, block_pages,
                                            cache_views, compute_dtype, empty_carry,
                                            kernel_refs, kv_rows, load_q, paged_loop,
                                            prepare_q, scale_acc, static_factors,
                                            store_rows, uses_pairs, validate)
from pallas_kernels.paged_attention import gather_kv, paged_attention
from pallas_kernels.split_combine import combine_call


def work_list(query_start, num_tokens: int, block_q: int, skip_single: bool = False,
              heavy_first: bool = False):
    """(row [W], block [W]) int32: program w handles q block block[w] of sequence row[w];
    row is -1 past the last real block. W is static (module docstring). skip_single leaves
    out rows with exactly one new token (the caller runs them through the decode kernel);
    heavy_first lists each row's blocks last (most KV to read) first."""
    batch = query_start.shape[0] - 1
    per_row = pl.cdiv(num_tokens, block_q)
    w = min(batch * per_row, batch + per_row)
    q_lens = query_start[1:] - query_start[:-1]
    blocks = (q_lens + block_q - 1) // block_q                       # [B]
    if skip_single:
        blocks = jnp.where(q_lens == 1, 0, blocks)
    ends = jnp.cumsum(blocks)                                         # [B]
    idx = jnp.arange(w, dtype=jnp.int32)
    row = jnp.searchsorted(ends, idx, side="right").astype(jnp.int32)
    live = idx < ends[-1]
    row_c = jnp.minimum(row, batch - 1)
    blk = idx - (ends[row_c] - blocks[row_c])
    if heavy_first:
        blk = blocks[row_c] - 1 - blk
    return jnp.where(live, row_c, -1), jnp.where(live, blk, 0).astype(jnp.int32)


def _ragged_kernel(layer_ref, row_ref, blk_ref, qstart_ref, pos_ref, table_ref, *refs,
                   groups: int, groups_p2: int, rows_q: int, pages_per_seq: int, blk,
                   num_kv_heads: int, num_pages: int, page_size: int, num_heads: int,
                   head_dim: int, num_tokens: int, qk_scale: float, fp8: bool, static: bool,
                   cdt, pairs: bool, interpret: bool):
    q_ref, k_ref, v_ref, ks_ref, vs_ref, rest = kernel_refs(refs, fp8)
    splits = blk.num_splits
    o_ref = rest[1] if splits == 1 else None    # past the aliased zeros; else the partials
    w, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row, i = row_ref[w], blk_ref[w]
    b = jnp.maximum(row, 0)
    q0 = qstart_ref[b]
    q_len = qstart_ref[b + 1] - q0

    @pl.when((row >= 0) & (i * blk.block_q < q_len))
    def _():
        r = jnp.arange(rows_q, dtype=jnp.int32)
        tokens = q0 + jnp.minimum(i * blk.block_q + r // groups_p2, q_len - 1)
        heads = h * groups + jnp.minimum(r % groups_p2, groups - 1)
        q, logit_scale = prepare_q(load_q(q_ref, tokens * num_heads + heads, pairs, head_dim),
                                   cdt, qk_scale)
        layer = layer_ref[0]
        ksr, vsr, k_factor, v_factor = static_factors(ks_ref, vs_ref, static, layer, h,
                                                      num_kv_heads)
        if k_factor is not None:
            logit_scale = logit_scale * k_factor
        pos = jnp.minimum(pos_ref[tokens], pages_per_seq * page_size - 1)  # [M]
        lo, hi = jnp.min(pos) + 1, jnp.max(pos) + 1
        bk = blk.block_tokens
        tok = jnp.arange(bk, dtype=jnp.int32)
        page_off, slots = tok // page_size, tok % page_size

        def read_pages(j):
            return block_pages(table_ref, b, j * bk, page_off, pages_per_seq, page_size)

        def body(j, pages, state, masked):
            rows = kv_rows(layer, h, pages, slots, num_kv_heads, num_pages, page_size)
            if not masked:
                return attend_block(q, k_ref, v_ref, ksr, vsr, rows, state,
                                    logit_scale=logit_scale, interpret=interpret)
            t = j * bk + tok
            return attend_block(q, k_ref, v_ref, ksr, vsr, rows, state,
                                logit_scale=logit_scale, logit_mask=t[None, :] <= pos[:, None],
                                kv_valid=t < hi, interpret=interpret)

        n_full, n_all = lo // bk, pl.cdiv(hi, bk)
        if splits == 1:
            _, l, acc = paged_loop(read_pages, body, empty_carry(rows_q, head_dim, pairs),
                                   n_full, n_all, blk.prefetch_table)
            acc = scale_acc(acc, v_factor)
            out = tuple(a / l[:, None] for a in acc) if pairs else acc / l[:, None]
            store_rows(o_ref, tokens * num_heads + heads, out, head_dim)
            return
        # split s takes blocks [first, last) of the q block's [0, n_all); an empty range
        # writes (M_INIT, 0, 0), which weighs nothing in the combine
        per = pl.cdiv(n_all, splits)
        first = jnp.minimum(s * per, n_all)
        last = jnp.minimum(first + per, n_all)
        m, l, acc = paged_loop(read_pages, body, empty_carry(rows_q, head_dim, pairs),
                               jnp.clip(n_full, first, last), last, blk.prefetch_table,
                               start=first)
        acc = scale_acc(acc, v_factor)
        acc_ref, m_ref, l_ref = rest
        flat = (s * num_tokens + tokens) * num_heads + heads
        store_rows(acc_ref, flat, acc, head_dim)
        m_ref[flat] = m
        l_ref[flat] = l


def _check_metadata(q, md):
    t, b = q.shape[0], md.page_table.shape[0]
    if md.positions.shape != (t,) or md.query_start.shape != (b + 1,):
        raise ValueError(f"metadata does not match q [T={t}, H, D]: positions "
                          f"{md.positions.shape}, query_start {md.query_start.shape}, "
                          f"page_table {md.page_table.shape}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "blocks", "skip_single"))
def ragged_paged_attention_blocks(q, k_pages, v_pages, layer, md, k_scale=None, v_scale=None,
                                  *, sm_scale: float, interpret: bool = False,
                                  blocks: tuning.RaggedBlocks, skip_single: bool = False):
    """The ragged kernel alone with explicit block sizes, over every row (for tuning and the
    tests); skip_single leaves rows with one new token at zero."""
    kv_heads, num_pages, page_size, head_dim = validate(q, k_pages, v_pages, k_scale, v_scale,
                                                        interpret, blocks.block_tokens)
    _check_metadata(q, md)
    num_tokens, num_heads, _ = q.shape
    batch, pages_per_seq = md.page_table.shape
    groups = num_heads // kv_heads
    groups_p2 = pow2_ceil(groups)
    pairs = uses_pairs(k_pages.dtype, blocks.fp8_compute, head_dim)
    splits = blocks.num_splits
    kernel = functools.partial(
        _ragged_kernel, groups=groups, groups_p2=groups_p2,
        rows_q=max(MIN_ROWS, groups_p2 * blocks.block_q), pages_per_seq=pages_per_seq,
        blk=blocks, num_kv_heads=kv_heads, num_pages=num_pages, page_size=page_size,
        num_heads=num_heads, head_dim=head_dim, num_tokens=num_tokens,
        qk_scale=float(sm_scale) * LOG2E, fp8=k_pages.dtype == FP8_DTYPE,
        static=k_scale is not None and is_static(k_scale),
        cdt=compute_dtype(k_pages.dtype, blocks.fp8_compute), pairs=pairs,
        interpret=interpret)
    q2d = q.reshape(-1, head_dim)
    views = cache_views(k_pages, v_pages, k_scale, v_scale, pairs)
    query_start = md.query_start.astype(jnp.int32)
    rows, q_blocks = work_list(query_start, num_tokens, blocks.block_q, skip_single,
                               blocks.heavy_first)
    args = (jnp.asarray(layer, jnp.int32).reshape(1), rows, q_blocks, query_start,
            md.positions.astype(jnp.int32), md.page_table.astype(jnp.int32).reshape(-1),
            q2d, *views)
    params = dict(grid=(rows.shape[0], kv_heads, splits), interpret=interpret,
                  name="jaxinfer_ragged_paged_attention",
                  **triton_params(interpret, blocks.num_warps, blocks.num_stages))
    if splits == 1:
        zeros = jnp.zeros(q2d.shape, q.dtype)
        out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(zeros.shape, q.dtype),
                             input_output_aliases={len(args): 0}, **params)(*args, zeros)
        return out.reshape(q.shape)
    part = splits * q2d.shape[0]
    ml = jax.ShapeDtypeStruct((part,), jnp.float32)
    partials = pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((part, head_dim), jnp.float32), ml, ml),
        **params)(*args)
    # the tokens some program covers: not padding, and not a skipped one-token row
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    live = t < query_start[-1]
    if skip_single:
        q_lens = query_start[1:] - query_start[:-1]
        live &= q_lens[jnp.clip(md.token_seq, 0, batch - 1)] > 1
    out = combine_call(*partials, splits=splits, rows=num_tokens, batch=num_tokens,
                       num_heads=num_heads, head_dim=head_dim, dtype=q.dtype,
                       interpret=interpret, live=live.astype(jnp.int32),
                       name="jaxinfer_ragged_combine")
    return out.reshape(q.shape)


def ragged_paged_attention(q, k_pages, v_pages, layer, md, k_scale=None, v_scale=None, *,
                           sm_scale: float, interpret: bool = False) -> jax.Array:
    """Attention of T new tokens over the paged cache. q [T, H, D]; md: AttentionMetadata
    (positions, query_start, page_table, seq_lens used); k/v pages [L, K, P, S, D], FP8 with
    k_scale/v_scale [L, K, P, S] or (static) [L, K]. Returns [T, H, D] in q.dtype; padding
    tokens output 0.

    Rows with exactly one new token (the decode rows of a mixed step) go through the decode
    kernel (pallas_kernels/paged_attention.py: 16-row tiles where the ragged kernel's are
    G' x block_q, and its split rule), the others through the ragged kernel; the decode
    kernel reads those rows' q from their token slots and writes their outputs there, into
    the ragged kernel's output (paged_attention's token_rows)."""
    _, kv_heads, _, page_size, head_dim = k_pages.shape
    blocks = tuning.ragged_blocks(jnp.dtype(k_pages.dtype).itemsize, head_dim, page_size,
                                  q.shape[0], kv_heads, md.page_table.shape[1] * page_size)
    out = ragged_paged_attention_blocks(q, k_pages, v_pages, layer, md, k_scale, v_scale,
                                        sm_scale=sm_scale, interpret=interpret,
                                        blocks=blocks, skip_single=True)
    starts = md.query_start[:-1]
    single = (md.query_start[1:] - starts) == 1
    return paged_attention(q, k_pages, v_pages, layer, jnp.where(single, md.seq_lens, 0),
                           md.page_table, k_scale, v_scale, sm_scale=sm_scale,
                           interpret=interpret, token_rows=jnp.where(single, starts, -1),
                           out=out)


REFERENCE_ROWS = 8             # the reference's per-row form up to this many rows (batch)
REFERENCE_LOGITS = 1 << 27     # ... and this many f32 logits (T x H x context: 512 MiB)


def _reference_tokens(q, k_pages, v_pages, layer, md, k_scale, v_scale, sm_scale: float):
    def one(args):  # q_t [H, D], pos, seq -> [H, D]
        q_t, pos, seq = args
        k, v = gather_kv(k_pages, v_pages, layer, md.page_table[seq][None], k_scale, v_scale)
        k, v = k[0], v[0]  # [K, t, D]
        kv_heads = k.shape[0]
        qg = q_t.astype(jnp.float32).reshape(kv_heads, -1, q_t.shape[-1])
        logits = jnp.einsum("kgd,ktd->kgt", qg, k, precision="highest") * sm_scale
        logits = jnp.where(jnp.arange(k.shape[1]) <= pos, logits, -jnp.inf)
        out = jnp.einsum("kgt,ktd->kgd", jax.nn.softmax(logits, axis=-1), v,
                         precision="highest")
        return out.reshape(q_t.shape)
    return lax.map(one, (q, md.positions, md.token_seq), batch_size=min(16, q.shape[0]))


def _reference_rows(q, k_pages, v_pages, layer, md, k_scale, v_scale, sm_scale: float):
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[1]
    group = num_heads // kv_heads
    qk = (q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim)
          .transpose(1, 0, 2, 3).reshape(kv_heads, num_tokens * group, head_dim))

    def one(out, b):  # every token against row b's pages; row b's tokens keep the result
        k, v = gather_kv(k_pages, v_pages, layer, md.page_table[b][None], k_scale, v_scale)
        k, v = k[0], v[0]  # [K, t, D]
        logits = jnp.einsum("kmd,ksd->kms", qk, k, precision="highest") * sm_scale
        logits = logits.reshape(kv_heads, num_tokens, group, -1)
        causal = jnp.arange(k.shape[1])[None, :] <= md.positions[:, None]  # [T, t]
        logits = jnp.where(causal[None, :, None, :], logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1).reshape(kv_heads, num_tokens * group, -1)
        o = jnp.einsum("kms,ksd->kmd", p, v, precision="highest")
        mine = jnp.repeat(md.token_seq == b, group)  # [T * G]
        return jnp.where(mine[None, :, None], o, out), None
    out, _ = lax.scan(one, jnp.zeros_like(qk), jnp.arange(md.page_table.shape[0]))
    return (out.reshape(kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
            .reshape(q.shape))


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def ragged_paged_attention_reference(q, k_pages, v_pages, layer, md, k_scale=None,
                                     v_scale=None, *, sm_scale: float, interpret: bool = False):
    """Plain-jnp version in f32: each token attends causally, up to its position, over its
    sequence's pages. Padding tokens (slot_mapping -1) output zeros.

    Two forms, the same numbers (tests/test_ragged_paged_attention.py): with few rows
    (REFERENCE_ROWS; teacher forcing, the CPU engine) each row's pages are gathered once and
    every token is scored against them, the row's own tokens keeping the result (memory:
    the T x H x context logits, bounded by REFERENCE_LOGITS); otherwise each token gathers
    its own row's pages, 16 tokens at a time (memory ~16 contexts). On the CPU the first is
    ~6x faster for one 512-token prefill, where the second's per-token gathers take most of
    the time."""
    del interpret
    context = md.page_table.shape[1] * k_pages.shape[3]
    per_row = (md.page_table.shape[0] <= REFERENCE_ROWS
               and q.shape[0] * q.shape[1] * context <= REFERENCE_LOGITS)
    fn = _reference_rows if per_row else _reference_tokens
    out = fn(q, k_pages, v_pages, layer, md, k_scale, v_scale, sm_scale)
    return jnp.where((md.slot_mapping >= 0)[:, None, None], out, 0.0).astype(q.dtype)
