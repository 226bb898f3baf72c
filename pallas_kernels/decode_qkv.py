"""The decode kernel's fused front: QKV's split-K partial products summed, RoPE, and the new
token's K/V written and attended, all inside the paged decode kernel (paged_attention.py with
`qkv`), for decode steps of few rows.

Unfused, a small decode step runs three kernels per layer before attention: XLA's QKV GEMM
(split 4 ways along the hidden dim, writing f32 partials), XLA's fusion summing them (times
the FP8 channel scales, rounded to bf16), and the RoPE + K/V write kernel (kv_write.py). Here
the model computes the split products itself (`partial_products`: a batched dot over slices
of the hidden dim, which XLA runs as fast as its own split-K GEMM) and the decode kernel
takes them:
- every program sums its kv head's q rows from the partials (f32), applies the channel scales
  and the bias, rotates them, rounding where the unfused route rounds (rope.apply_rope,
  kv_write.rope_write_kv), and keeps q as its two rotary halves: the logits are q_lo k_lo^T
  + q_hi k_hi^T with K read as two half-rows (attention_block.attend_block's `q_halves`);
- the cache does not hold the new token yet: the programs attend over seq_len - 1 cached
  tokens, and the one program whose split holds the new position (one per row and kv head)
  rotates that token's k, quantizes k and v as the cache stores them (kv_write's numerics),
  writes them into their page slot (the cache arrays are aliased in and out) and folds the
  token into its online softmax from registers (`fold`). No other program reads that slot
  (its own loop masks it), so no program waits on another's write.
The RMSNorm before QKV can be folded in as well (`norm_eps`, `norm_factor`;
ops.front_norm_applies): the partials are products of the residual rows times the norm's
weight and every program computes its row's 1 / rms from those rows. Kernel counts and step
times: docs/performance.md.

Limits (`supported`): the cache read as plain rows and a power-of-two head dim. FP8 KV that
the decode table reads as f16pairs' byte pairs (head dim 128) is read here as plain rows
widened to f16 (`front_blocks`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kv_pages import FP8_DTYPE, KVCache
from pallas_kernels import tuning
from pallas_kernels.kv_write import cache_from, quantized

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class QKVSpec:
    """What the decode kernel's fused front needs to know statically."""
    num_heads: int   # H
    width: int       # H + 2K: head rows of one token's projection
    tokens: int      # T: rows of each partial product
    parts: int       # S: partial products summed
    scaled: bool     # FP8 weights: per-channel scales multiply the sum
    bias: bool       # the projection's bias (Qwen2)
    dtype: str       # the activations' dtype: where the unfused route rounds
    norm_eps: float | None = None   # the RMSNorm folded (norm_factor): its eps, else None


def partial_products(x, kernel, parts: int):
    """x [T, E] times QKV's weight as `parts` products over slices of E -> [S, T, N] f32,
    unscaled. kernel: [E, N] in the compute dtype, or FP8 [N, E] (checkpoints/fp8.py's
    layout), widened to bf16 inside XLA's GEMM as fp8_matmul.xla_dequant_matmul does."""
    t, e = x.shape
    if e % parts:
        raise ValueError(f"partial_products: hidden size {e} is not a multiple of {parts}")
    xs = x.reshape(t, parts, e // parts)
    if kernel.dtype == FP8_DTYPE:
        w = kernel.reshape(kernel.shape[0], parts, e // parts).astype(jnp.bfloat16)
        return jnp.einsum("tsk,nsk->stn", xs.astype(jnp.bfloat16), w,
                          preferred_element_type=F32)
    w = kernel.reshape(parts, e // parts, kernel.shape[1]).astype(x.dtype)
    return jnp.einsum("tsk,skn->stn", xs, w, preferred_element_type=F32)


def projection_reference(partials, scale, dtype):
    """The projection the partials make, as ops.linear returns it: summed, times the FP8
    channel scales (or None), in the activations' dtype -> [T, N]."""
    y = jnp.sum(partials, axis=0)
    return (y if scale is None else y * scale[None, :]).astype(dtype)


def split_refs(refs, spec: QKVSpec):
    """The fused front's refs ahead of the kernel's q ref -> ((slots, cos, sin, channel
    scales or None, bias or None, the residual rows or None), the rest)."""
    slot_ref, cos_ref, sin_ref, rest = refs[0], refs[1], refs[2], refs[3:]
    ws_ref, rest = (rest[0], rest[1:]) if spec.scaled else (None, rest)
    b_ref, rest = (rest[0], rest[1:]) if spec.bias else (None, rest)
    x_ref, rest = (rest[0], rest[1:]) if spec.norm_eps is not None else (None, rest)
    return (slot_ref, cos_ref, sin_ref, ws_ref, b_ref, x_ref), rest


def operands(spec: QKVSpec, slot_mapping, cos, sin, scale, bias, head_dim: int,
             x=None) -> list:
    """split_refs' operands, in its order (x: the residual rows, with norm_eps)."""
    ops = [slot_mapping.astype(jnp.int32), cos.astype(F32), sin.astype(F32)]
    if spec.scaled:
        ops.append(scale.astype(F32).reshape(-1, head_dim))
    if spec.bias:
        ops.append(bias.astype(spec.dtype).reshape(-1, head_dim))
    if spec.norm_eps is not None:
        ops.append(x)
    return ops


NORM_CHUNK = 2048    # the most elements of a residual row norm_factor loads at once


def norm_factor(front, t, spec: QKVSpec):
    """`front` for row t: with norm_eps, its residual-rows ref replaced by that row's RMSNorm
    factor 1 / sqrt(mean(x^2) + eps) (f32, 0-d), which the projection's sum then takes
    (_head_rows): the partials are then products of x times the norm's weight, and the
    factor, a scalar per row, commutes with the matmul. The row is read in power-of-two
    chunks (Triton's blocks), the largest dividing the hidden size, at most NORM_CHUNK."""
    x_ref = front[5]
    if x_ref is None:
        return front
    e = x_ref.shape[1]
    chunk = min(e & -e, NORM_CHUNK)
    ss = jnp.zeros((), F32)
    for c in range(e // chunk):          # static: one load per chunk
        x = x_ref[t, pl.ds(c * chunk, chunk)].astype(F32)
        ss = ss + jnp.sum(x * x)
    return front[:5] + (jax.lax.rsqrt(ss / e + spec.norm_eps),)


def _head_rows(p_ref, front, t, heads, cols, spec: QKVSpec):
    """Head rows `heads` [R] of token t's projection at columns `cols`, as the unfused route
    has them (the parts summed in f32, times the channel scales, rounded to the activations'
    dtype, plus the bias, rounded): [R, cols] f32. With the norm folded (norm_factor) the
    sum first takes the row's factor."""
    _, _, _, ws_ref, b_ref, factor = front
    dtype = jnp.dtype(spec.dtype)
    acc = p_ref[t * spec.width + heads, cols]
    for p in range(1, spec.parts):
        acc = acc + p_ref[(p * spec.tokens + t) * spec.width + heads, cols]
    if factor is not None:
        acc = acc * factor
    if ws_ref is not None:
        acc = acc * ws_ref[heads, cols]
    x = acc.astype(dtype)
    if b_ref is not None:
        x = (x.astype(F32) + b_ref[heads, cols].astype(F32)).astype(dtype)
    return x.astype(F32)


def rotated(p_ref, front, t, heads, spec: QKVSpec, half: int):
    """Rows `heads` of token t, rotated (rope.apply_rope's math, rounded to the activations'
    dtype as it rounds): the (low, high) halves [R, D/2] f32."""
    _, cos_ref, sin_ref = front[:3]
    dtype = jnp.dtype(spec.dtype)
    c, s = cos_ref[t][None, :], sin_ref[t][None, :]
    x1 = _head_rows(p_ref, front, t, heads, pl.ds(0, half), spec)
    x2 = _head_rows(p_ref, front, t, heads, pl.ds(half, half), spec)
    return ((x1 * c - x2 * s).astype(dtype).astype(F32),
            (x2 * c + x1 * s).astype(dtype).astype(F32))


def q_halves(p_ref, front, t, heads, spec: QKVSpec, half: int):
    """The q rows `heads` of token t for attention: rotated halves in the activations'
    dtype (what kv_write.rope_write_kv hands the unfused kernel)."""
    dtype = jnp.dtype(spec.dtype)
    return tuple(x.astype(dtype) for x in rotated(p_ref, front, t, heads, spec, half))


def _stored(parts, fp8: bool, static, cache_dtype):
    """K or V parts [1, d] f32 as the cache stores them (kv_write.quantized, cast to the
    cache's dtype): (the values the kernel reads back, f32; the per-token scale [1] or
    None)."""
    values, scale = quantized(parts, fp8, static)
    return [x.astype(cache_dtype).astype(F32) for x in values], scale


def new_token(p_ref, front, t, kv_head, spec: QKVSpec, head_dim: int, fp8: bool, statics,
              cache_dtype):
    """Token t's K (rotated) and V for `kv_head`, as the cache will hold them: (k halves
    [1, D/2] x 2, k scale [1] or None, v [1, D], v scale or None); statics: the head's static
    (k, v) scales [1] each, or (None, None)."""
    half = head_dim // 2
    k_row = jnp.full((1,), spec.num_heads, jnp.int32) + kv_head
    v_row = k_row + (spec.width - spec.num_heads) // 2
    k_vals, k_scale = _stored(list(rotated(p_ref, front, t, k_row, spec, half)), fp8,
                              statics[0], cache_dtype)
    v_vals, v_scale = _stored([_head_rows(p_ref, front, t, v_row, pl.ds(0, head_dim), spec)],
                              fp8, statics[1], cache_dtype)
    return k_vals, k_scale, v_vals[0], v_scale


def write(cache_outs, row, token, head_dim: int):
    """new_token's values into cache row `row` ([1] int32) of the aliased outputs (k, v
    views [rows, D], and per-token scale views [rows] or None)."""
    kc, vc, ks, vs = cache_outs
    k_vals, k_scale, v_vals, v_scale = token
    half = head_dim // 2
    kc[row, pl.ds(0, half)] = k_vals[0].astype(kc.dtype)
    kc[row, pl.ds(half, half)] = k_vals[1].astype(kc.dtype)
    vc[row, pl.ds(0, head_dim)] = v_vals.astype(vc.dtype)
    if ks is not None:
        ks[row] = k_scale
        vs[row] = v_scale


def fold(carry, q, logit_scale, token):
    """One more online-softmax step, over new_token's single token held in registers: q the
    (low, high) halves [M, D/2] in the compute dtype, logit_scale as attend_block takes it.
    Per-token scales multiply the logit and V (static ones are the caller's, as for the
    cached tokens)."""
    m, l, acc = carry
    k_vals, k_scale, v_vals, v_scale = token
    s = (jnp.sum(q[0].astype(F32) * k_vals[0], axis=1, keepdims=True)
         + jnp.sum(q[1].astype(F32) * k_vals[1], axis=1, keepdims=True))        # [M, 1]
    if k_scale is not None:
        s = s * k_scale[:, None]
    s = jnp.sum(s * logit_scale, axis=1)                                        # [M]
    m_new = jnp.maximum(m, s)
    alpha, p = jnp.exp2(m - m_new), jnp.exp2(s - m_new)
    v = v_vals if v_scale is None else v_vals * v_scale[:, None]                # [1, D]
    return m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * v


def select(cond, new, old):
    """The carry `new` where cond holds, else `old` (tuples of arrays)."""
    return jax.tree.map(lambda a, b: jnp.where(cond, a, b), new, old)


def front_blocks(blocks, kv_dtype, head_dim: int):
    """`blocks` as the fused front reads the cache: FP8 KV that the table reads as f16pairs'
    byte pairs (its choice at head dim 128) is read as plain rows widened to f16 instead,
    with the same f16 numerics (attention_block's "float16"): q's rotary halves
    (attend_block's q_halves) and the pairs' even/odd halves do not compose. Faster at
    batch 1, context 512, the only shape measured; at long contexts the plain rows' FP8
    reads may cost more than the pairs'."""
    from pallas_kernels.attention_block import uses_pairs
    if uses_pairs(kv_dtype, blocks.fp8_compute, head_dim):
        return dataclasses.replace(blocks, fp8_compute="float16")
    return blocks


def table_blocks(cache: KVCache, page_table, rows: int):
    """The decode table's blocks (tuning.decode_blocks) for `rows` rows over this cache and
    page table, as the front reads them (front_blocks)."""
    _, kv_heads, _, page_size, head_dim = cache.k.shape
    return front_blocks(tuning.decode_blocks(
        rows, kv_heads, page_table.shape[1] * page_size, page_size,
        jnp.dtype(cache.k.dtype).itemsize, head_dim), cache.k.dtype, head_dim)


def supported(cache: KVCache, blocks) -> bool:
    """Whether the fused front takes this cache with these decode blocks: plain rows (not
    f16pairs) and a power-of-two head dim."""
    from pallas_kernels.attention_block import uses_pairs
    d = cache.k.shape[-1]
    return (d & (d - 1) == 0 and d >= 16
            and not uses_pairs(cache.k.dtype, blocks.fp8_compute, d))


def paged_attention_qkv(partials, scale, bias, cos, sin, cache: KVCache, layer, seq_lens,
                        page_table, slot_mapping, *, num_heads: int, sm_scale: float,
                        dtype, interpret: bool = False, rows: int | None = None,
                        longest_first: bool | None = None, masked_loads: bool | None = None,
                        blocks=None, x=None, norm_eps: float | None = None):
    """Decode attention from QKV's partial products (module doc): partials [S, T, (H+2K)D]
    f32 (partial_products), scale [(H+2K)D] (FP8 weights) or None, bias [(H+2K)D] or None,
    cos/sin [T, D/2], the cache (its new tokens not written), seq_lens [T] counting each
    row's new token, page_table [T, pages], slot_mapping [T] (-1: padding), dtype the
    activations'. rows, longest_first, masked_loads: as paged_attention_blocks'. blocks:
    table_blocks' choice when None. With the RMSNorm before the projection folded (norm_eps
    given): partials are products of x [T, E] (the residual rows, activations' dtype) times
    the norm's weight, and each row's sum takes 1 / sqrt(mean(x^2) + norm_eps)
    (norm_factor).
    -> (out [T, H, D] in dtype, the cache with the new tokens written: updated in place
    inside a jit that owns it)."""
    from pallas_kernels import paged_attention as pa
    parts, t, width = partials.shape
    _, kv_heads, num_pages, page_size, head_dim = cache.k.shape
    if blocks is None:
        blocks = table_blocks(cache, page_table, rows or t)
    if (width != (num_heads + 2 * kv_heads) * head_dim or cos.shape != (t, head_dim // 2)
            or sin.shape != cos.shape or seq_lens.shape != (t,) or slot_mapping.shape != (t,)
            or page_table.shape[0] != t or not supported(cache, blocks)
            or (rows is not None and not 0 < rows <= t)
            or (norm_eps is not None and (x is None or x.ndim != 2 or x.shape[0] != t))):
        raise ValueError(f"paged_attention_qkv: partials {partials.shape} (want [S, T, "
                         f"{(num_heads + 2 * kv_heads) * head_dim}]), cos/sin {cos.shape}, "
                         f"seq_lens {seq_lens.shape}, slot_mapping {slot_mapping.shape}, "
                         f"page_table {page_table.shape}, rows {rows}, blocks {blocks}, "
                         f"x {None if x is None else x.shape} with norm_eps {norm_eps} "
                         f"(plain rows and a power-of-two head dim only)")
    spec = QKVSpec(num_heads, num_heads + 2 * kv_heads, t, parts, scale is not None,
                   bias is not None, jnp.dtype(dtype).name,
                   None if norm_eps is None else float(norm_eps))
    longest_first, masked_loads = tuning.grid_rules(t, rows, kv_heads, blocks.num_splits,
                                                    longest_first, masked_loads)
    out, written = pa._paged_attention_blocks(
        partials, cache.k, cache.v, layer, seq_lens, page_table, cache.k_scale, cache.v_scale,
        sm_scale=sm_scale, interpret=interpret, blocks=blocks, rows=rows,
        longest_first=longest_first, masked_loads=masked_loads, qkv=spec,
        front=tuple(operands(spec, slot_mapping, cos, sin, scale, bias, head_dim, x)))
    return out, cache_from(cache, written)
