"""The paged KV cache's arrays as the kernels read and write them, with the FP8 numerics of
the K/V write and its plain-jnp reference (an XLA scatter).

    k, v:       [L, K, P, S, D]   layer, kv head, page, slot in page, head dim
    k_scale,
    v_scale:    [L, K, P, S] f32  FP8 (e4m3) KV with per-token scales, one per token and kv head
                or [L, K] f32     static scales, one per layer and kv head (calibrated)

One kv head's page is a contiguous [S, D] tile: the decode kernel streams whole pages and
reads each page once for all the q heads of its group. The layer index is a traced scalar
that kernels and the write apply themselves, so no layer slice is ever copied.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import FP8_DTYPE, FP8_MAX


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "k_scale", "v_scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array                    # [L, K, P, S, D]
    v: jax.Array                    # [L, K, P, S, D]
    k_scale: jax.Array | None = None  # [L, K, P, S] or (static) [L, K] f32, FP8 only
    v_scale: jax.Array | None = None  # [L, K, P, S] or (static) [L, K] f32, FP8 only

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def is_fp8(self) -> bool:
        return self.k.dtype == FP8_DTYPE

    @property
    def dtype(self) -> jnp.dtype:
        return self.k.dtype

    @property
    def static_scales(self) -> bool:
        """FP8 with one scale per layer and kv head (module docstring)."""
        return self.k_scale is not None and is_static(self.k_scale)

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    def stacked(self) -> "KVCache":
        """All layers in one KVCache: this one (KVLayers.stacked's counterpart)."""
        return self

    def layer(self, i: int) -> tuple["KVCache", int]:
        """The cache layer i reads and writes, and its index there: this one, i."""
        return self, i

    def with_layer(self, i: int, cache: "KVCache") -> "KVCache":
        """The pool after layer i wrote `cache` (layer(i)'s cache, updated): that cache."""
        return cache

    @staticmethod
    def allocate(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
                 head_dim: int, dtype, scales=None) -> "KVCache":
        """Zeroed pages. FP8: scales (k_scale, v_scale) [L, K] makes the static form with
        those scales; None the per-token form."""
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        dtype = jnp.dtype(dtype)
        if dtype != FP8_DTYPE:
            if scales is not None:
                raise ValueError(f"static KV scales are for FP8 KV, not {dtype}")
            return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        if scales is None:
            return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                           jnp.ones(shape[:-1], jnp.float32), jnp.ones(shape[:-1], jnp.float32))
        ks, vs = (jnp.asarray(x, jnp.float32) for x in scales)
        if ks.shape != shape[:2] or vs.shape != shape[:2]:
            raise ValueError(f"static KV scales must be [L, K] = {list(shape[:2])}; got "
                              f"{list(ks.shape)} and {list(vs.shape)}")
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), ks, vs)


def is_static(scale) -> bool:
    """Whether an FP8 scale array is the static form ([L, K]) rather than per token
    ([L, K, P, S])."""
    return scale.ndim == 2


def quantize_static(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., K, D] over static per-kv-head scales [K] -> e4m3 codes, saturated at +-448 (a
    value past the calibrated range keeps its sign and the largest code)."""
    y = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def fp8_scale(amax: jax.Array) -> jax.Array:
    """A K/V vector's e4m3 scale from its amax."""
    return jnp.maximum(amax, 1e-12) / FP8_MAX


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-vector (last axis) symmetric e4m3 quantization: x ~= q * scale."""
    scale = fp8_scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1))
    q = (x.astype(jnp.float32) / scale[..., None]).astype(FP8_DTYPE)
    return q, scale


def write_kv(cache: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> KVCache:
    """Scatter the new tokens' K/V ([T, K, D]) into their slots of `layer`: a tiny scatter
    of T*K*D elements into the donated cache, no pass over the rest of it. The reference
    route beside kv_write.py's kernel."""
    s, p = cache.page_size, cache.num_pages
    page = jnp.where(slot_mapping < 0, p, slot_mapping // s)  # p is out of bounds -> dropped
    slot = slot_mapping % s
    if cache.static_scales:
        return dataclasses.replace(
            cache,
            k=cache.k.at[layer, :, page, slot].set(quantize_static(k, cache.k_scale[layer]),
                                                   mode="drop"),
            v=cache.v.at[layer, :, page, slot].set(quantize_static(v, cache.v_scale[layer]),
                                                   mode="drop"))
    if cache.is_fp8:
        kq, ks = quantize_fp8(k)
        vq, vs = quantize_fp8(v)
        return dataclasses.replace(
            cache,
            k=cache.k.at[layer, :, page, slot].set(kq, mode="drop"),
            v=cache.v.at[layer, :, page, slot].set(vq, mode="drop"),
            k_scale=cache.k_scale.at[layer, :, page, slot].set(ks, mode="drop"),
            v_scale=cache.v_scale.at[layer, :, page, slot].set(vs, mode="drop"))
    return dataclasses.replace(
        cache, k=cache.k.at[layer, :, page, slot].set(k.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[layer, :, page, slot].set(v.astype(cache.v.dtype), mode="drop"))
