"""The new tokens' K/V written into their pages in one kernel (FP8: quantized on the way).

jaxinfer/kv_cache.py's write_kv left to XLA is, for FP8 KV, one fusion taking each token-head
row's amax for K and V and four scatters (K codes, V codes, their scales) that recompute their
inputs from the QKV product (the one read in the HLO: RoPE and the scale): ~12.7 us per layer
in the 8B FP8 decode step at 256 rows on the H200 (2.4 us for the amax fusion, 10.2 for the
scatters; profile and HLO of the same process, ninth session). Here one program per new token
reads its K and V rows [K, D], takes each head's amax, and stores the e4m3 codes and the f32
scales (bf16/f32 caches: the cast rows) straight into the cache, whose four arrays are aliased
in and out: nothing but the new tokens' slots is touched, as with the scatter. Tokens with
slot -1 (padding) write nothing.

Numerics: those of kv_cache.quantize_fp8 (its fp8_scale: max(amax, 1e-12) / 448; codes rounded to
nearest), up to the division's last bit on the GPU.

Cache layout and views: k, v [L, K, P, S, D] viewed as rows [L*K*P*S, D] and scales as
[L*K*P*S] (pallas_kernels/attention_block.py's cache_views, free reshapes); a token's rows
are ((layer * K + head) * P + page) * S + slot, one per kv head. K is padded to a power of
two inside the kernel (Triton's tiles): the extra rows repeat the last head, which writes the
same values to the same places twice instead of needing masked stores.
Backend: Pallas Triton, as the attention kernels (pallas_kernels/paged_attention.py says why).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxinfer.kv_cache import KVCache, fp8_scale
from pallas_kernels import triton_params


def _kernel(layer_ref, slot_ref, k_ref, v_ref, kc_in, vc_in, *refs, kv_heads: int,
            heads_p2: int, num_pages: int, page_size: int, fp8: bool):
    del kc_in, vc_in     # aliased to the outputs below
    if fp8:
        _ks_in, _vs_in, kc_ref, vc_ref, ks_ref, vs_ref = refs
    else:
        kc_ref, vc_ref = refs
    t = pl.program_id(0)
    slot = slot_ref[t]

    @pl.when(slot >= 0)
    def _():
        # padded heads repeat the last one: the same value to the same place, no mask
        heads = jnp.minimum(jnp.arange(heads_p2, dtype=jnp.int32), kv_heads - 1)
        src = t * kv_heads + heads                                        # rows of k/v [T*K, D]
        page, within = slot // page_size, slot % page_size
        rows = ((layer_ref[0] * kv_heads + heads) * num_pages + page) * page_size + within
        for x_ref, c_ref, s_ref in ((k_ref, kc_ref, ks_ref if fp8 else None),
                                    (v_ref, vc_ref, vs_ref if fp8 else None)):
            x = x_ref[src]                                                # [K', D]
            if fp8:
                xf = x.astype(jnp.float32)
                scale = fp8_scale(jnp.max(jnp.maximum(xf, -xf), axis=1))
                c_ref[rows] = (xf / scale[:, None]).astype(c_ref.dtype)
                s_ref[rows] = scale
            else:
                c_ref[rows] = x.astype(c_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(cache: KVCache, layer, k, v, slot_mapping, *, interpret: bool = False) -> KVCache:
    """kv_cache.write_kv as one Pallas kernel: k, v [T, K, D] (the new tokens, any float
    dtype), slot_mapping [T] (page * S + slot, -1 = padding), layer an int32 scalar. Inside
    a jit that owns (or was donated) the cache, its buffers are updated in place; called on
    its own, XLA copies the cache first (the caller keeps the old one)."""
    _, kv_heads, num_pages, page_size, head_dim = cache.k.shape
    t = k.shape[0]
    if k.shape != (t, kv_heads, head_dim) or v.shape != k.shape or slot_mapping.shape != (t,):
        raise ValueError(f"write_kv: want k, v [T, {kv_heads}, {head_dim}] and slot_mapping "
                         f"[T]; got {k.shape}, {v.shape}, {slot_mapping.shape}")
    fp8 = cache.is_fp8
    views = [cache.k.reshape(-1, head_dim), cache.v.reshape(-1, head_dim)]
    if fp8:
        views += [cache.k_scale.reshape(-1), cache.v_scale.reshape(-1)]
    kernel = functools.partial(_kernel, kv_heads=kv_heads,
                               heads_p2=1 << (kv_heads - 1).bit_length(),
                               num_pages=num_pages, page_size=page_size, fp8=fp8)
    params = triton_params(interpret, num_warps=1, num_stages=1)
    outs = pl.pallas_call(
        kernel, grid=(t,),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in views],
        input_output_aliases={4 + i: i for i in range(len(views))},
        interpret=interpret, name="jaxinfer_kv_write", **params,
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32),
      k.reshape(t * kv_heads, head_dim), v.reshape(t * kv_heads, head_dim), *views)
    shape = cache.k.shape
    if fp8:
        return KVCache(outs[0].reshape(shape), outs[1].reshape(shape),
                       outs[2].reshape(shape[:-1]), outs[3].reshape(shape[:-1]))
    return KVCache(outs[0].reshape(shape), outs[1].reshape(shape))


def supported(cache: KVCache) -> bool:
    """Triton tiles: the head dim must be a power of two (kv heads are padded)."""
    d = cache.k.shape[-1]
    return d & (d - 1) == 0 and d >= 16

