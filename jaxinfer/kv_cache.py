"""The paged KV cache and the metadata that tells attention where each token's K/V live.

Layout (chosen for the decode kernel, see pallas_kernels/paged_attention.py):

    k, v:       [L, K, P, S, D]   layer, kv head, page, slot in page, head dim
    k_scale,
    v_scale:    [L, K, P, S] f32  only for FP8 (e4m3) KV, per-token scales: one per token
                                  and kv head
                or [L, K] f32     static scales: one per layer and kv head (calibrated)

One kv head's page is a contiguous [S, D] tile, so the decode kernel streams whole pages with
wide loads and reads each page once for all the q heads of its group. Kernels and the K/V
write index the layer themselves, so no layer slice is ever copied.

Two forms of the pool (runner.allocate_kv picks by the decoder's layer loop):
- KVCache, one array of all layers: the scanned decoder carries it through lax.scan, whose
  layer index is traced.
- KVLayers, one KVCache of L = 1 per layer: the unrolled decoder (the GPU default) hands
  layer i's own arrays to its kernels, with index 0. Pallas's Triton lowering computes a
  load's element offsets in 64-bit integers when the array holds >= 2**32 bytes (jax's
  pallas/triton/lowering.py, _compute_offsets_from_indices). A stacked pool is that big at
  serving sizes (~18 GiB per K for 8B at 384 rows of 1,536 tokens), a layer's share is not
  (~0.6 GiB). The FP8 decode kernel took ~7% longer over the big arrays (H200, B=384
  S=1536, us per call: 300 over a 1.1 GiB one-layer array, 321 over an 18 GiB 32-layer
  one, 322 over a 4.06 GiB one-layer one; bench/probes/layers.py, bench/README.md).

Page 0 is reserved (never handed out by the allocator): padded page-table entries point at
it, so padded rows read valid memory; padded tokens (slot -1) write nothing.

FP8 scales come in two forms (EngineConfig.kv_scales), told apart by the scale arrays' rank:
- per token and kv head ("token"): a token is quantized alone when it is written, with no
  re-quantizing of the page it lands in and nothing to calibrate; the attention kernels load
  one scale per K and V row and apply it per logit column / p column.
- static, one per layer and kv head ("static", the default): calibrated once when the engine
  starts (jaxinfer/kv_calibration.py: the amax of each layer's and head's K and V over a
  calibration forward, with headroom), codes saturate at +-448 past it. The kernels fold K's
  scale into the logit scale and V's into the output, so their block loop is the bf16 one's
  plus the widening: no scale loads or math per block. H200, the tuned FP8 decode kernel
  per-token -> static, one call (bench/results/kv_scales.json, twenty-sixth session): B=64
  S=2048 80.4 -> 75.8 us, B=256 S=2048 279.8 -> 266.4; the offline throughput run 16,570 ->
  17,190 output tokens/s on one machine. Quality: bench/README.md and kv_calibration.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import ConfigError

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "k_scale", "v_scale", "counters"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array                    # [L, K, P, S, D]
    v: jax.Array                    # [L, K, P, S, D]
    k_scale: jax.Array | None = None  # [L, K, P, S] or (static) [L, K] f32, FP8 only
    v_scale: jax.Array | None = None  # [L, K, P, S] or (static) [L, K] f32, FP8 only
    # Within one decode step only, never in the pool: zeros [rows * K] f32 the split decode
    # kernels count their programs on (split_combine.last_combines_in_kernel), handed from
    # layer to layer (model.Decoder) and zero again after each kernel.
    counters: jax.Array | None = None

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
                raise ConfigError(f"static KV scales are for FP8 KV, not {dtype}")
            return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        if scales is None:
            return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                           jnp.ones(shape[:-1], jnp.float32), jnp.ones(shape[:-1], jnp.float32))
        ks, vs = (jnp.asarray(x, jnp.float32) for x in scales)
        if ks.shape != shape[:2] or vs.shape != shape[:2]:
            raise ConfigError(f"static KV scales must be [L, K] = {list(shape[:2])}; got "
                              f"{list(ks.shape)} and {list(vs.shape)}")
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), ks, vs)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVLayers:
    """The pool as one KVCache per layer, each of shape [1, K, P, S, D] (module docstring):
    layer i reads and writes layers[i] at layer index 0."""
    layers: tuple[KVCache, ...]

    @property
    def num_pages(self) -> int:
        return self.layers[0].num_pages

    @property
    def page_size(self) -> int:
        return self.layers[0].page_size

    @property
    def is_fp8(self) -> bool:
        return self.layers[0].is_fp8

    @property
    def dtype(self) -> jnp.dtype:
        return self.layers[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def stacked(self) -> KVCache:
        """A copy as one KVCache of all layers (tests and inspection: the whole pool twice)."""
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *self.layers)

    def layer(self, i: int) -> tuple[KVCache, int]:
        """The cache layer i reads and writes, and its index there: its own, 0."""
        return self.layers[i], 0

    def with_layer(self, i: int, cache: KVCache) -> "KVLayers":
        """The pool after layer i wrote `cache` (layer(i)'s cache, updated)."""
        return KVLayers(self.layers[:i] + (cache,) + self.layers[i + 1:])

    @property
    def static_scales(self) -> bool:
        return self.layers[0].static_scales

    @staticmethod
    def allocate(num_layers: int, *args, scales=None) -> "KVLayers":
        """KVCache.allocate's arguments: num_layers caches of one layer each (static scales
        [L, K]: layer i gets row i)."""
        def rows(i):
            return None if scales is None else tuple(jnp.asarray(x)[i:i + 1] for x in scales)
        return KVLayers(tuple(KVCache.allocate(1, *args, scales=rows(i))
                              for i in range(num_layers)))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["positions", "slot_mapping", "token_seq", "page_table", "seq_lens",
                 "query_start"],
    meta_fields=["decode_only", "attend_rows"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where the T new tokens of one step sit. T and B are the bucket's padded sizes.

    A sequence's new tokens are contiguous in T: tokens query_start[b]:query_start[b+1] belong
    to row b, at positions seq_lens[b] - q_len[b] ... seq_lens[b] - 1.
    """

    positions: jax.Array     # [T] i32  position of each new token in its sequence
    slot_mapping: jax.Array  # [T] i32  page * S + slot where its K/V go; -1 for padding
    token_seq: jax.Array     # [T] i32  row in the batch of each token (padding: 0)
    page_table: jax.Array    # [B, pages_per_seq] i32  (padding: page 0)
    seq_lens: jax.Array      # [B] i32  context length including this step's tokens (padding: 0)
    query_start: jax.Array   # [B+1] i32  cumulative new-token counts
    decode_only: bool = False  # static: every row has exactly one new token and T == B
    # static, decode only: rows past this one are padding added on the device
    # (pad_decode_rows), which attention skips; 0 = attend every row
    attend_rows: int = 0


def single_sequence_metadata(positions, page_ids, page_size: int,
                             pages_per_seq: int) -> AttentionMetadata:
    """Metadata for new tokens at `positions` of one sequence living in pages `page_ids`
    (teacher forcing and tests: no scheduler). Positions and pages are host integers."""
    positions = np.asarray(positions, np.int32)
    pages = np.asarray(page_ids, np.int32)
    table = np.zeros((1, pages_per_seq), np.int32)
    table[0, :len(pages)] = pages
    slots = pages[positions // page_size] * page_size + positions % page_size
    t = len(positions)
    return AttentionMetadata(
        positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots, jnp.int32),
        token_seq=jnp.zeros(t, jnp.int32), page_table=jnp.asarray(table),
        seq_lens=jnp.asarray([positions[-1] + 1], jnp.int32),
        query_start=jnp.asarray([0, t], jnp.int32), decode_only=t == 1)


def pad_decode_rows(tokens: jax.Array, md: AttentionMetadata, rows: int):
    """A decode step's tokens [B] and metadata padded to `rows` rows, the padding as batch.py
    pads a bucket: token 0 at position 0 writing nothing (slot -1), an empty context (seq_len
    0, page 0), zero new tokens. Row b keeps its results at index b. Attention runs on the
    first `B` rows only (attend_rows): its split of the context follows the rows it gets
    (pallas_kernels/tuning.py), and the real rows keep theirs."""
    t = tokens.shape[0]
    if not md.decode_only or t >= rows:
        return tokens, md
    n = rows - t

    def pad(a, value):
        return jnp.pad(a, [(0, n)] + [(0, 0)] * (a.ndim - 1), constant_values=value)

    return pad(tokens, 0), AttentionMetadata(
        pad(md.positions, 0), pad(md.slot_mapping, -1), pad(md.token_seq, 0),
        pad(md.page_table, 0), pad(md.seq_lens, 0),
        jnp.concatenate([md.query_start, jnp.broadcast_to(md.query_start[-1:], (n,))]),
        decode_only=True, attend_rows=t)


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
    """A K/V vector's e4m3 scale from its amax (pallas_kernels/kv_write.py uses it too)."""
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
    route; with Pallas attention ops.write_kv runs pallas_kernels/kv_write.py instead."""
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
