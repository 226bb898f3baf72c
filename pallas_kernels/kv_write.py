"""The new tokens' K/V written into their pages in one kernel (FP8: quantized on the way).

Left to XLA, the reference write (kv_pages.write_kv) is for FP8 KV one fusion taking each
token-head row's amax for K and V and four scatters (K codes, V codes, their scales) that
recompute their inputs from the QKV product. Here one program per new token reads its K and
V rows [K, D], takes each head's amax, and stores the e4m3 codes and the f32 scales (bf16/f32
caches: the cast rows) straight into the cache, whose four arrays are aliased in and out:
nothing but the new tokens' slots is touched, as with the scatter. Tokens with slot -1
(padding) write nothing.

Numerics: those of kv_pages.quantize_fp8 (its fp8_scale: max(amax, 1e-12) / 448; codes
rounded to nearest), up to the division's last bit on the GPU.

Cache layout and views: k, v [L, K, P, S, D] viewed as rows [L*K*P*S, D] and scales as
[L*K*P*S] (pallas_kernels/attention_block.py's cache_views, free reshapes); a token's rows
are ((layer * K + head) * P + page) * S + slot, one per kv head. K is padded to a power of
two inside the kernel (Triton's tiles): the extra rows repeat the last head, which writes the
same values to the same places twice instead of needing masked stores.

`rope_write_kv` is the same write with RoPE in front: it takes the fused QKV projection's
output, rotates q and k (rope.apply_rope's math and rounding: f32, then the activations'
dtype) and writes k and v; q comes back [T, H, D] for attention. XLA would run the rotation
and the slices feeding the write and attention as small kernels of their own. With `bias`
(Qwen2's QKV bias) the projection's bias is added here too, as the Linear would have (rounded
to the activations' dtype before the rotation), instead of in an XLA fusion of its own. With
`scales` (the fused FP8 layer's route, above 64 rows) qkv is the FP8 tensor-core GEMM's
unscaled product and the per-token and per-channel scales are applied here
(fp8_matmul.tc_scaled's math, rounded to the activations' dtype before the bias), instead of
by an XLA fusion that reads and writes the whole product. Measurements: docs/performance.md.

Backend: Pallas Triton, as the attention kernels (pallas_kernels/paged_attention.py says why).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kv_pages import FP8_MAX, KVCache, fp8_scale, write_kv as write_kv_reference
from pallas_kernels import pow2_ceil, triton_params
from pallas_kernels.fp8_matmul import tc_scaled
from pallas_kernels.rope import apply_rope


def quantized(parts, fp8: bool, static=None):
    """K/V pieces ([K', d] f32) as the cache stores them, before the cast to its dtype: ->
    (the pieces, the per-row scale [K'] to store or None). FP8: divided by one scale per row
    over all its pieces (fp8_scale of the row's amax), or with `static` [K'] (the rows' heads'
    static scales) saturated at +-448 (kv_pages.quantize_static), no scale stored; else as
    they are."""
    if static is not None:
        return [jnp.clip(x / static[:, None], -FP8_MAX, FP8_MAX) for x in parts], None
    if fp8:
        amax = functools.reduce(jnp.maximum, [jnp.max(jnp.maximum(x, -x), axis=1)
                                              for x in parts])
        scale = fp8_scale(amax)
        return [x / scale[:, None] for x in parts], scale
    return list(parts), None


def _store(c_ref, s_ref, rows, parts, cols, fp8: bool, static=None):
    """Rows `rows` of the cache view c_ref get `parts` ([K', d] f32 pieces of each row at
    column slices `cols`), quantized as `quantized` says; a per-row scale into s_ref."""
    values, scale = quantized(parts, fp8, static)
    for x, c in zip(values, cols):
        c_ref[rows, c] = x.astype(c_ref.dtype)
    if scale is not None:
        s_ref[rows] = scale


def _cache_refs(refs, fp8: bool, static: bool):
    """The kernels' refs from the K/V caches on -> (static k/v scale refs or None, the
    outputs: k cache, v cache, per-token k/v scale refs or None). Static scales are inputs
    ([L*K]) before the caches; per-token ones are caches aliased in and out like K/V."""
    ksi, vsi, refs = (refs[0], refs[1], refs[2:]) if static else (None, None, refs)
    refs = refs[2:]                                # the K/V caches in, aliased to outputs
    if fp8 and not static:
        return ksi, vsi, (refs[2], refs[3], refs[4], refs[5])     # past the scales in
    return ksi, vsi, (refs[0], refs[1], None, None)


def _static_scales(ksi, vsi, layer, heads, kv_heads: int):
    """The static K and V scales [K'] of `heads` at `layer` (None, None without them)."""
    if ksi is None:
        return None, None
    idx = layer * kv_heads + heads
    return ksi[idx], vsi[idx]


def _kernel(layer_ref, slot_ref, k_ref, v_ref, *refs, kv_heads: int, heads_p2: int,
            num_pages: int, page_size: int, fp8: bool, static: bool):
    ksi, vsi, (kc_ref, vc_ref, ks_ref, vs_ref) = _cache_refs(refs, fp8, static)
    t = pl.program_id(0)
    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _():
        # padded heads repeat the last one: the same value to the same place, no mask
        heads = jnp.minimum(jnp.arange(heads_p2, dtype=jnp.int32), kv_heads - 1)
        src = t * kv_heads + heads                                        # rows of k/v [T*K, D]
        page, within = slot // page_size, slot % page_size
        rows = ((layer_ref[0] * kv_heads + heads) * num_pages + page) * page_size + within
        k_static, v_static = _static_scales(ksi, vsi, layer_ref[0], heads, kv_heads)
        whole = pl.ds(0, k_ref.shape[1])
        _store(kc_ref, ks_ref, rows, [k_ref[src].astype(jnp.float32)], [whole], fp8, k_static)
        _store(vc_ref, vs_ref, rows, [v_ref[src].astype(jnp.float32)], [whole], fp8, v_static)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(cache: KVCache, layer, k, v, slot_mapping, *, interpret: bool = False) -> KVCache:
    """kv_pages.write_kv as one Pallas kernel: k, v [T, K, D] (the new tokens, any float
    dtype), slot_mapping [T] (page * S + slot, -1 = padding), layer an int32 scalar. Inside
    a jit that owns (or was donated) the cache, its buffers are updated in place; called on
    its own, XLA copies the cache first (the caller keeps the old one)."""
    _, kv_heads, num_pages, page_size, head_dim = cache.k.shape
    t = k.shape[0]
    if k.shape != (t, kv_heads, head_dim) or v.shape != k.shape or slot_mapping.shape != (t,):
        raise ValueError(f"write_kv: want k, v [T, {kv_heads}, {head_dim}] and slot_mapping "
                         f"[T]; got {k.shape}, {v.shape}, {slot_mapping.shape}")
    static, views = _views(cache)
    kernel = functools.partial(_kernel, kv_heads=kv_heads,
                               heads_p2=pow2_ceil(kv_heads),
                               num_pages=num_pages, page_size=page_size, fp8=cache.is_fp8,
                               static=bool(static))
    params = triton_params(interpret, num_warps=1, num_stages=1)
    first = 4 + len(static)             # the first cache view's operand index
    outs = pl.pallas_call(
        kernel, grid=(t,),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views],
        input_output_aliases={first + i: i for i in range(len(views))},
        interpret=interpret, name="jaxinfer_kv_write", **params,
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32),
      k.reshape(t * kv_heads, head_dim), v.reshape(t * kv_heads, head_dim), *static, *views)
    return cache_from(cache, outs)


def _views(cache: KVCache):
    """(static scale operands [L*K] (or none), the cache arrays the kernels write, as rows:
    K/V [L*K*P*S, D] and per-token scales [L*K*P*S])."""
    d = cache.k.shape[-1]
    views = [cache.k.reshape(-1, d), cache.v.reshape(-1, d)]
    if cache.static_scales:
        return [cache.k_scale.reshape(-1), cache.v_scale.reshape(-1)], views
    if cache.is_fp8:
        views += [cache.k_scale.reshape(-1), cache.v_scale.reshape(-1)]
    return [], views


def cache_from(cache: KVCache, outs) -> KVCache:
    """The cache after a kernel wrote `outs` (the flat k, v views and, per-token FP8, the
    scale views, updated); its other fields as they were."""
    shape = cache.k.shape
    k, v = outs[0].reshape(shape), outs[1].reshape(shape)
    if len(outs) == 4:
        return dataclasses.replace(cache, k=k, v=v, k_scale=outs[2].reshape(shape[:-1]),
                                   v_scale=outs[3].reshape(shape[:-1]))
    return dataclasses.replace(cache, k=k, v=v)


def supported(cache: KVCache) -> bool:
    """Triton tiles: the head dim must be a power of two (kv heads are padded)."""
    d = cache.k.shape[-1]
    return d & (d - 1) == 0 and d >= 16


ROPE_WARPS = 4   # a program rotates all H q heads of its token


def _rope_kernel(layer_ref, slot_ref, qkv_ref, cos_ref, sin_ref, *refs, num_heads: int,
                 q_p2: int, kv_heads: int, kv_p2: int, num_pages: int, page_size: int,
                 half: int, fp8: bool, static: bool, bias: bool, scaled: bool):
    xs_ref, ws_ref, refs = (refs[0], refs[1], refs[2:]) if scaled else (None, None, refs)
    b_ref, refs = (refs[0], refs[1:]) if bias else (None, refs)
    n_in = 2 + (2 if static else 0) + (2 if fp8 and not static else 0)  # caches (+ scales)
    q_ref = refs[n_in]
    ksi, vsi, (kc_ref, vc_ref, ks_ref, vs_ref) = _cache_refs(
        refs[:n_in] + refs[n_in + 1:], fp8, static)
    t = pl.program_id(0)
    width = num_heads + 2 * kv_heads              # rows of qkv [T * width, D] per token
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    c, s = cos_ref[t][None, :], sin_ref[t][None, :]                       # [1, D/2]
    dtype = qkv_ref.dtype

    def row(head, cols):  # qkv's head row of token t (scaled and + its bias, rounded as
        x = qkv_ref[t * width + head, cols]      # fp8_matmul.tc_scaled and the Linear round)
        if xs_ref is not None:
            x = (x.astype(jnp.float32) * xs_ref[t] * ws_ref[head, cols]).astype(dtype)
        if b_ref is not None:
            x = (x.astype(jnp.float32) + b_ref[head, cols].astype(jnp.float32)).astype(dtype)
        return x.astype(jnp.float32)

    def rotated(head):    # rope.apply_rope on head rows of qkv: f32, rounded to its dtype
        x1, x2 = row(head, lo), row(head, hi)
        return [(x1 * c - x2 * s).astype(dtype).astype(jnp.float32),
                (x2 * c + x1 * s).astype(dtype).astype(jnp.float32)]

    # padded heads repeat the last one: the same value to the same place, no mask
    qh = jnp.minimum(jnp.arange(q_p2, dtype=jnp.int32), num_heads - 1)
    q1, q2 = rotated(qh)
    q_ref[t * num_heads + qh, lo] = q1.astype(q_ref.dtype)
    q_ref[t * num_heads + qh, hi] = q2.astype(q_ref.dtype)
    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _():
        heads = jnp.minimum(jnp.arange(kv_p2, dtype=jnp.int32), kv_heads - 1)
        page, within = slot // page_size, slot % page_size
        rows = ((layer_ref[0] * kv_heads + heads) * num_pages + page) * page_size + within
        k_static, v_static = _static_scales(ksi, vsi, layer_ref[0], heads, kv_heads)
        _store(kc_ref, ks_ref, rows, rotated(num_heads + heads), [lo, hi], fp8, k_static)
        _store(vc_ref, vs_ref, rows, [row(num_heads + kv_heads + heads, pl.ds(0, 2 * half))],
               [pl.ds(0, 2 * half)], fp8, v_static)


def _split_qkv(qkv, num_heads: int, kv_heads: int, head_dim: int):
    t = qkv.shape[0]
    q, k, v = jnp.split(qkv.reshape(t, num_heads + 2 * kv_heads, head_dim),
                        [num_heads, num_heads + kv_heads], axis=1)
    return q, k, v


def rope_write_kv_reference(cache: KVCache, layer, qkv, cos, sin, slot_mapping, *,
                            num_heads: int, bias=None, scales=None):
    """Plain jnp (model.Attention's route): -> (cache with the new K/V, q [T, H, D]); scales
    (x_scale [T, 1], w_scale [(H + 2K) D], or None) multiply qkv first, as
    fp8_matmul.tc_scaled; bias [(H + 2K) D] (or None) is added next, as ops.linear adds it."""
    _, kv_heads, _, _, head_dim = cache.k.shape
    if scales is not None:
        qkv = tc_scaled(qkv, *scales, qkv.dtype)
    if bias is not None:
        qkv = qkv + bias.astype(qkv.dtype)
    q, k, v = _split_qkv(qkv, num_heads, kv_heads, head_dim)
    cache = write_kv_reference(cache, layer, apply_rope(k, cos, sin), v, slot_mapping)
    return cache, apply_rope(q, cos, sin)


@functools.partial(jax.jit, static_argnames=("num_heads", "interpret"))
def rope_write_kv(cache: KVCache, layer, qkv, cos, sin, slot_mapping, *, num_heads: int,
                  bias=None, scales=None, interpret: bool = False):
    """rope_write_kv_reference in one kernel (module doc): qkv [T, (H + 2K) D] ([q | k | v]
    heads, the projection's output, without its bias when `bias` [(H + 2K) D] is given, and
    unscaled when `scales` is: the FP8 tensor-core product and its (per-token x_scale [T, 1],
    per-channel w_scale [(H + 2K) D]) scales, applied here instead of in an XLA fusion of
    their own), cos/sin [T, D/2] f32, slot_mapping [T] (-1 = padding: nothing written, q
    still rotated). Returns (the cache, q [T, H, D] in qkv's dtype); the cache is updated in
    place as write_kv's."""
    _, kv_heads, num_pages, page_size, head_dim = cache.k.shape
    t = qkv.shape[0]
    half = head_dim // 2
    width = (num_heads + 2 * kv_heads) * head_dim
    if (qkv.shape != (t, width) or cos.shape != (t, half) or sin.shape != cos.shape
            or slot_mapping.shape != (t,) or (bias is not None and bias.shape != (width,))
            or (scales is not None and (scales[0].shape != (t, 1)
                                        or scales[1].shape != (width,)))):
        raise ValueError(f"rope_write_kv: want qkv [T, {num_heads + 2 * kv_heads} * "
                         f"{head_dim}], cos/sin [T, {half}], slot_mapping [T], bias None or "
                         f"[{width}], scales None or ([T, 1], [{width}]); got {qkv.shape}, "
                         f"{cos.shape}, {sin.shape}, {slot_mapping.shape}, "
                         f"{None if bias is None else bias.shape}, "
                         f"{None if scales is None else [x.shape for x in scales]}")
    static, views = _views(cache)
    kernel = functools.partial(_rope_kernel, num_heads=num_heads, q_p2=pow2_ceil(num_heads),
                               kv_heads=kv_heads, kv_p2=pow2_ceil(kv_heads), num_pages=num_pages,
                               page_size=page_size, half=half, fp8=cache.is_fp8,
                               static=bool(static), bias=bias is not None,
                               scaled=scales is not None)
    extra = [] if scales is None else [scales[0].reshape(-1).astype(jnp.float32),
                                       scales[1].reshape(-1, head_dim).astype(jnp.float32)]
    extra += [] if bias is None else [bias.astype(qkv.dtype).reshape(-1, head_dim)]
    extra += static
    q_out = jax.ShapeDtypeStruct((t * num_heads, head_dim), qkv.dtype)
    first = 5 + len(extra)              # the first cache view's operand index
    outs = pl.pallas_call(
        kernel, grid=(t,),
        out_shape=[q_out] + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views],
        input_output_aliases={first + i: 1 + i for i in range(len(views))},
        interpret=interpret, name="jaxinfer_rope_kv_write",
        **triton_params(interpret, num_warps=ROPE_WARPS, num_stages=1),
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32),
      qkv.reshape(-1, head_dim), cos.astype(jnp.float32), sin.astype(jnp.float32), *extra,
      *views)
    return cache_from(cache, outs[1:]), outs[0].reshape(t, num_heads, head_dim)
