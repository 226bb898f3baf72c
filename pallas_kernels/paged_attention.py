"""Paged flash-decode attention: one query token per sequence over the paged KV cache.

Cache layout (pallas_kernels/kv_pages.py): k, v [L, K, P, S, D]; FP8 e4m3 KV carries f32
scales, one per page slot and kv head, k_scale/v_scale [L, K, P, S] (a token's K row is q8 *
scale), or static, one per layer and kv head, [L, K] (applied once per program). The layer
index is a traced scalar: the kernel reads the layer's pages in place, no slice of the cache
is ever copied.

Kernel: grid (B, K, splits), or (K, B, 1) with the rows longest first (the window
tuning.LONGEST_FIRST_PROGRAMS). One program owns one sequence, one kv head and one split of the
context, and holds all G = H/K q heads of that kv head as the rows of one tile (padded to 16
rows for the tensor cores by repeating the last head), so each K/V page is read from HBM
once. Per step it gathers `block_tokens` KV rows through the page table (with
blocks.prefetch_table, the next block's page ids are read one step ahead: see
attention_block.paged_loop), computes logits = q k^T (f32 accumulate), runs the online
softmax in f32 (base 2, scale folded in), and accumulates p v. Full blocks run unmasked;
only the tail block of a split masks positions >= seq_len (and zeroes their V rows, so stale
slot contents never leak; on grids of tuning.MASKED_LOADS_MIN_PROGRAMS or more its loads skip
those rows instead).
With splits > 1 each split writes its unnormalized accumulator and (max, sum); a second
small kernel (split_combine.py, one program per row and q head) merges them.
Padded rows (seq_len 0) output zeros.

`rows` (static) says that only q's first rows are real (a decode step padded on the device,
kv_cache.pad_decode_rows): the split of the context is chosen for those rows, the grid runs
over them only when the context is split (the padding rows would each cost a program and
its partials), and the combine writes the padding rows' zeros, so the output has q's shape
without a pad or slice around the kernels (XLA runs those as kernels of their own).

`token_rows` (with `out`) is the ragged path's form (a mixed step's decode rows): q is the
step's token array, row b reads token token_rows[b]'s q and writes its output into that row
of `out` (the ragged kernel's output, aliased, updated in place; -1: nothing written), the
combine likewise, so no gather of q or scatter of outputs runs around the kernels.

FP8 KV numerics and the block step both kernels run: pallas_kernels/attention_block.py.

With `qkv` (pallas_kernels/decode_qkv.py, small decode steps) q comes as QKV's split-K
partial products: the kernel sums, scales and rotates them, and writes and attends the new
token's K/V itself, so no RoPE or K/V write kernel runs before it.

Backend: the Pallas Triton backend, because it compiles on jax 0.10.2 and 0.11.x and runs in
interpret mode on the CPU for the tests; its numbers on the H200 are in docs/performance.md.
The public functions take no backend argument, so another backend can replace the kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kv_pages import FP8_DTYPE, is_static
from pallas_kernels import LOG2E, pow2_ceil, triton_params, tuning
from pallas_kernels import decode_qkv as dq
from pallas_kernels.split_combine import combine_call
from pallas_kernels.attention_block import (MIN_ROWS, attend_block, block_pages,
                                            cache_views, compute_dtype, empty_carry,
                                            kernel_refs, kv_rows, load_q, paged_loop,
                                            prepare_q, scale_acc, static_factors,
                                            store_rows, uses_pairs, validate)


def _decode_kernel(layer_ref, lens_ref, table_ref, order_ref, trows_ref, *refs, groups: int,
                   rows_q: int, pages_per_seq: int, split_tokens: int, blk,
                   num_kv_heads: int, num_pages: int, page_size: int, num_heads: int,
                   head_dim: int, batch: int, qk_scale: float, fp8: bool, static: bool,
                   cdt, pairs: bool, longest_first: bool, masked_loads: bool,
                   token_rows: bool, interpret: bool, qkv: dq.QKVSpec | None = None):
    # with pairs, q and the accumulator are (even, odd) halves (load_q, store_rows); with
    # qkv, q_ref holds QKV's partial products and the cache views are outputs too
    front, refs = dq.split_refs(refs, qkv) if qkv is not None else (None, refs)
    q_ref, k_ref, v_ref, ks_ref, vs_ref, outs = kernel_refs(refs, fp8)
    if qkv is not None:
        written = 4 if fp8 and not static else 2      # aliased cache views, after the outputs
        outs, cache_outs = outs[:-written], (outs[-written:] + (None, None))[:4]
    if longest_first:   # grid (K, B, 1): a row's kv heads side by side, rows by rank
        h, b, s = pl.program_id(0), order_ref[pl.program_id(1)], pl.program_id(2)
    else:
        b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # token_rows: row b's q is token trows[b] of q (and its output goes there; -1: none)
    tb = trows_ref[b] if token_rows else b
    if token_rows and len(outs) == 2:
        outs = outs[1:]                  # past the aliased output's input
    layer = layer_ref[0]
    ks_ref, vs_ref, k_factor, v_factor = static_factors(ks_ref, vs_ref, static, layer, h,
                                                        num_kv_heads)
    heads = h * groups + jnp.minimum(jnp.arange(rows_q, dtype=jnp.int32), groups - 1)
    q_row = jnp.maximum(tb, 0) if token_rows else b
    if qkv is not None:
        front = dq.norm_factor(front, b, qkv)      # row b's RMSNorm factor, if folded
        q = dq.q_halves(q_ref, front, b, heads, qkv, head_dim // 2)
    else:
        q = load_q(q_ref, q_row * num_heads + heads, pairs, head_dim)
    q, logit_scale = prepare_q(q, cdt, qk_scale)
    if k_factor is not None:
        logit_scale = logit_scale * k_factor
    seq_len = jnp.minimum(lens_ref[b], pages_per_seq * page_size)
    cached = seq_len - 1 if qkv is not None else seq_len   # qkv: the new token not yet in
    start = s * split_tokens
    n = jnp.clip(cached - start, 0, split_tokens)
    bk = blk.block_tokens
    tok = jnp.arange(bk, dtype=jnp.int32)
    page_off, slots = tok // page_size, tok % page_size

    def read_pages(i):
        return block_pages(table_ref, b, start + i * bk, page_off, pages_per_seq, page_size)

    def body(i, pages, state, masked):
        rows = kv_rows(layer, h, pages, slots, num_kv_heads, num_pages, page_size)
        valid = (start + i * bk + tok < cached) if masked else None
        return attend_block(q, k_ref, v_ref, ks_ref, vs_ref, rows, state,
                            logit_scale=logit_scale,
                            logit_mask=None if valid is None else valid[None, :],
                            kv_valid=valid, masked_loads=masked_loads,
                            interpret=interpret, q_halves=qkv is not None)

    if qkv is not None:
        # the new token: read and written before the loop, so its loads do not wait behind
        # the loop (this program's loop masks its slot), folded in after it by the program
        # whose split holds it
        ones = jnp.ones((1,), jnp.float32)
        statics = (k_factor * ones, v_factor * ones) if static else (None, None)
        token = dq.new_token(q_ref, front, b, h, qkv, head_dim, fp8, statics, k_ref.dtype)
        here = (cached >= start) & (cached < start + split_tokens)
        slot = front[0][b]
        row = kv_rows(layer, h, slot // page_size, slot % page_size, num_kv_heads, num_pages,
                      page_size) * jnp.ones((1,), jnp.int32)
        pl.when(here & (slot >= 0))(lambda: dq.write(cache_outs, row, token, head_dim))
    carry = paged_loop(read_pages, body, empty_carry(rows_q, head_dim, pairs), n // bk,
                       pl.cdiv(n, bk), blk.prefetch_table)
    if qkv is not None:
        carry = dq.select(here, dq.fold(carry, q, logit_scale, token), carry)
    m, l, acc = carry
    acc = scale_acc(acc, v_factor)
    if len(outs) == 1:
        inv = 1.0 / jnp.where(l > 0, l, 1.0)[:, None]
        out = tuple(a * inv for a in acc) if pairs else acc * inv

        def store():
            store_rows(outs[0], tb * num_heads + heads, out, head_dim)
        if token_rows:
            pl.when(tb >= 0)(store)
        else:
            store()
    else:
        o_ref, m_ref, l_ref = outs
        flat = (s * batch + b) * num_heads + heads
        store_rows(o_ref, flat, acc, head_dim)
        m_ref[flat] = m
        l_ref[flat] = l


def paged_attention_blocks(q, k_pages, v_pages, layer, seq_lens, page_table, k_scale=None,
                           v_scale=None, *, sm_scale: float, interpret: bool = False,
                           blocks: tuning.DecodeBlocks, rows: int | None = None,
                           longest_first: bool | None = False,
                           masked_loads: bool | None = None, token_rows=None, out=None):
    """paged_attention with explicit block sizes (for tuning and the tests);
    longest_first: the rows longest first (unsplit grids only; None: within
    tuning.LONGEST_FIRST_PROGRAMS, counting the real rows' programs); masked_loads: the last
    blocks' loads masked (None: from tuning.MASKED_LOADS_MIN_PROGRAMS, counting the grid's). Both
    rules are resolved here, outside the jit, so the compiled kernel's cache is keyed by
    their outcome, not by the module settings at its first trace. token_rows, out: see
    paged_attention."""
    kv_heads = validate(q, k_pages, v_pages, k_scale, v_scale, interpret,
                        blocks.block_tokens)[0]
    total = q.shape[0] if token_rows is None else token_rows.shape[0]
    if seq_lens.shape != (total,) or page_table.ndim != 2 or page_table.shape[0] != total:
        raise ValueError(f"seq_lens {seq_lens.shape} / page_table {page_table.shape} do not "
                          f"match batch {total}")
    if rows is not None and not 0 < rows <= total:
        raise ValueError(f"rows {rows}: want 1..{total} (q's rows)")
    if (token_rows is None) != (out is None) or (token_rows is not None and (
            rows is not None or token_rows.ndim != 1 or out.shape != q.shape)):
        raise ValueError(f"token_rows and out go together (token_rows [B], out of q's shape "
                          f"{q.shape}, no rows); got {getattr(token_rows, 'shape', None)}, "
                          f"{getattr(out, 'shape', None)}, rows {rows}")
    longest_first, masked_loads = tuning.grid_rules(total, rows, kv_heads, blocks.num_splits,
                                                    longest_first, masked_loads)
    return _paged_attention_blocks(q, k_pages, v_pages, layer, seq_lens, page_table, k_scale,
                                   v_scale, sm_scale=sm_scale, interpret=interpret,
                                   blocks=blocks, rows=rows, longest_first=longest_first,
                                   masked_loads=masked_loads, token_rows=token_rows, out=out)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "blocks", "rows",
                                             "longest_first", "masked_loads", "qkv"))
def _paged_attention_blocks(q, k_pages, v_pages, layer, seq_lens, page_table, k_scale,
                            v_scale, *, sm_scale: float, interpret: bool,
                            blocks: tuning.DecodeBlocks, rows: int | None,
                            longest_first: bool, masked_loads: bool, token_rows=None,
                            out=None, qkv: dq.QKVSpec | None = None, front=()):
    """paged_attention_blocks after its checks and rules: the kernel call. With `qkv`
    (decode_qkv.py) q is QKV's partial products [S, T, N] and `front` decode_qkv.operands;
    -> (the output, the cache views written)."""
    _, kv_heads, num_pages, page_size, head_dim = k_pages.shape
    total = seq_lens.shape[0]
    if qkv is None:
        num_heads, q_shape, q_dtype = q.shape[1], q.shape, q.dtype
    else:
        num_heads, q_dtype = qkv.num_heads, jnp.dtype(qkv.dtype)
        q_shape = (qkv.tokens, num_heads, head_dim)
    scatter = token_rows is not None
    trows = token_rows.astype(jnp.int32) if scatter else None
    n = blocks.num_splits
    batch = tuning.grid_rows(total, rows, n)
    pages_per_seq = page_table.shape[1]
    per_split = pl.cdiv(pages_per_seq * page_size, blocks.num_splits)
    split_tokens = pl.cdiv(per_split, blocks.block_tokens) * blocks.block_tokens
    groups = num_heads // kv_heads
    rows_q = max(MIN_ROWS, pow2_ceil(groups))
    pairs = uses_pairs(k_pages.dtype, blocks.fp8_compute, head_dim)
    lens = seq_lens.astype(jnp.int32)
    order = (jnp.argsort(-lens).astype(jnp.int32) if longest_first
             else jnp.zeros((1,), jnp.int32))     # the rows by rank (else not read)
    kernel = functools.partial(
        _decode_kernel, groups=groups, rows_q=rows_q, pages_per_seq=pages_per_seq,
        split_tokens=split_tokens, blk=blocks, num_kv_heads=kv_heads, num_pages=num_pages,
        page_size=page_size, num_heads=num_heads, head_dim=head_dim, batch=batch,
        qk_scale=float(sm_scale) * LOG2E, fp8=k_pages.dtype == FP8_DTYPE,
        static=k_scale is not None and is_static(k_scale),
        cdt=compute_dtype(k_pages.dtype, blocks.fp8_compute), pairs=pairs,
        longest_first=longest_first, masked_loads=masked_loads, token_rows=scatter,
        interpret=interpret, qkv=qkv)
    heads_rows = batch * num_heads
    views = cache_views(k_pages, v_pages, k_scale, v_scale, pairs)
    args = [jnp.asarray(layer, jnp.int32).reshape(1), lens,
            page_table.astype(jnp.int32).reshape(-1), order,
            trows if scatter else jnp.zeros((1,), jnp.int32), *front,
            q.reshape(-1, head_dim), *views]
    aliases = {}
    if n == 1 and scatter:      # the rows' outputs written into out's token rows, in place
        out_shape = (jax.ShapeDtypeStruct((q.shape[0] * num_heads, head_dim), q.dtype),)
        aliases = {len(args): 0}
        args.append(out.reshape(-1, head_dim))
    elif n == 1:
        out_shape = (jax.ShapeDtypeStruct((heads_rows, head_dim), q_dtype),)
    else:
        ml = jax.ShapeDtypeStruct((n * heads_rows,), jnp.float32)
        out_shape = (jax.ShapeDtypeStruct((n * heads_rows, head_dim), jnp.float32), ml, ml)
    written = 0
    if qkv is not None:         # the cache views (per-token scales too) aliased in and out
        written = 4 if len(views) == 4 and not is_static(k_scale) else 2
        first = len(args) - len(views)
        aliases.update({first + i: len(out_shape) + i for i in range(written)})
        out_shape += tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views[:written])
    grid = (kv_heads, batch, n) if longest_first else (batch, kv_heads, n)
    outs = pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, interpret=interpret,
        input_output_aliases=aliases,
        **triton_params(interpret, blocks.num_warps, blocks.num_stages),
        name="jaxinfer_paged_decode" + ("_pairs" if pairs else "") + ("_qkv" if qkv else ""),
    )(*args)
    outs, cache_out = (outs[:len(outs) - written], outs[len(outs) - written:])
    if n == 1:
        res = outs[0]
    else:
        res = combine_call(*outs, splits=n, rows=batch, batch=total, num_heads=num_heads,
                           head_dim=head_dim, dtype=q_dtype, interpret=interpret,
                           token_rows=trows,
                           out=out.reshape(-1, head_dim) if scatter else None)
    return res.reshape(q_shape) if qkv is None else (res.reshape(q_shape), cache_out)


def paged_attention(q, k_pages, v_pages, layer, seq_lens, page_table, k_scale=None,
                    v_scale=None, *, sm_scale: float, interpret: bool = False,
                    rows: int | None = None, longest_first: bool | None = False,
                    token_rows=None, out=None) -> jax.Array:
    """Decode attention. q [B, H, D]; k/v pages [L, K, P, S, D]; layer int32 scalar (may be
    traced); seq_lens [B] (0 = padded row, outputs zeros); page_table [B, pages_per_seq];
    k_scale/v_scale [L, K, P, S] (per token) or [L, K] (static) f32 for FP8 pages; rows
    (static): only the first `rows` rows are real, the rest padding (their seq_lens 0;
    module doc). longest_first (static): the rows in grid order (False), longest first
    (True; unsplit grids only) or, None, longest first within tuning.LONGEST_FIRST_PROGRAMS (the
    model: its layers' sorts of the same lengths are one in the compiled step, XLA's CSE).
    Returns [B, H, D] in q.dtype.
    token_rows [B] int32 with out [T, H, D] (module doc): q [T, H, D] is a token array; the
    rows' outputs land in out's token rows in place and out is returned, its other rows as
    they were (no XLA gather of q or scatter of outputs runs around the kernel).
    Block sizes come from pallas_kernels/tuning.py; shapes and dtypes are static (a new one
    recompiles)."""
    _, kv_heads, _, page_size, head_dim = k_pages.shape
    blocks = tuning.decode_blocks(rows or seq_lens.shape[0], kv_heads,
                                  page_table.shape[1] * page_size, page_size,
                                  jnp.dtype(k_pages.dtype).itemsize, head_dim)
    return paged_attention_blocks(q, k_pages, v_pages, layer, seq_lens, page_table, k_scale,
                                  v_scale, sm_scale=sm_scale, interpret=interpret,
                                  blocks=blocks, rows=rows, longest_first=longest_first,
                                  token_rows=token_rows, out=out)


def gather_kv(k_pages, v_pages, layer, page_table, k_scale=None, v_scale=None):
    """Dense f32 K/V of the given rows' pages: page_table [N, pages] -> [N, K, pages*S, D]."""
    def one(pages, scale):
        x = jnp.take(pages[layer], page_table, axis=1).astype(jnp.float32)  # [K, N, p, S, D]
        if scale is not None and is_static(scale):
            x = x * scale[layer][:, None, None, None, None]
        elif scale is not None:
            x = x * jnp.take(scale[layer], page_table, axis=1)[..., None]
        x = jnp.moveaxis(x, 1, 0)
        return x.reshape(*x.shape[:2], -1, x.shape[-1])
    return one(k_pages, k_scale), one(v_pages, v_scale)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def paged_attention_reference(q, k_pages, v_pages, layer, seq_lens, page_table, k_scale=None,
                              v_scale=None, *, sm_scale: float, interpret: bool = False):
    """Plain-jnp decode attention in f32: gathers each row's pages (memory ~ the rows'
    contexts in f32), masks positions >= seq_len; padded rows output zeros."""
    del interpret
    k, v = gather_kv(k_pages, v_pages, layer, page_table, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    logits = jnp.einsum("bkgd,bktd->bkgt", qg, k, precision="highest") * sm_scale
    valid = jnp.arange(k.shape[2])[None, :] < seq_lens[:, None]  # [B, t]
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(valid[:, None, None, :], p, 0.0)  # padded rows: all-masked -> zeros
    out = jnp.einsum("bkgt,bktd->bkgd", p, v, precision="highest")
    return out.reshape(q.shape).astype(q.dtype)
