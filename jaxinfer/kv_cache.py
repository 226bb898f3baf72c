"""The engine's KV pool and the metadata that tells attention where each token's K/V live.

The arrays and their FP8 numerics are pallas_kernels/kv_pages.py's `KVCache` (the layout the
kernels read). Two forms of the pool (allocate_kv picks by the decoder's layer loop):
- KVCache, one array of all layers: the scanned decoder carries it through lax.scan, whose
  layer index is traced.
- KVLayers, one KVCache of L = 1 per layer: the unrolled decoder (the GPU default) hands
  layer i's own arrays to its kernels, with index 0. Pallas's Triton lowering computes a
  load's offsets in 64-bit integers when an array holds >= 2**32 bytes, which a stacked pool
  does at serving sizes and a layer's share does not (the FP8 decode kernel ran ~7% longer
  over the big arrays; docs/performance.md).

Page 0 is reserved (never handed out by the allocator): padded page-table entries point at
it, so padded rows read valid memory; padded tokens (slot -1) write nothing.

FP8 scales come in two forms (EngineConfig.kv_scales), told apart by the scale arrays' rank:
- per token and kv head ("token"): a token is quantized alone when it is written, with
  nothing to calibrate; the attention kernels load one scale per K and V row.
- static, one per layer and kv head ("static", the default): calibrated once when the engine
  starts (kv_calibration.py), codes saturate at +-448 past it. The kernels fold K's scale
  into the logit scale and V's into the output: no scale loads in their block loop.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.sharding import TPLayout, kv_spec
from pallas_kernels import FP8_DTYPE
from pallas_kernels.kv_pages import KVCache


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


def kv_dtype_for(engine: EngineConfig):
    if engine.kv_dtype == "fp8":
        return FP8_DTYPE
    if engine.kv_dtype == "bf16":
        return jnp.bfloat16
    return jnp.dtype(engine.dtype)


def kv_page_bytes(cfg: ModelConfig, engine: EngineConfig) -> int:
    """One page's bytes over all layers: K and V, and with per-token FP8 scales those (f32;
    static ones are [L, K] for the whole pool)."""
    dtype = jnp.dtype(kv_dtype_for(engine))
    token_scales = dtype == FP8_DTYPE and engine.kv_scales == "token"
    per_slot = cfg.head_dim * dtype.itemsize + (4 if token_scales else 0)
    return 2 * cfg.num_layers * cfg.num_kv_heads * engine.page_size * per_slot


def kv_pool_gib(cfg: ModelConfig, engine: EngineConfig) -> float:
    """The whole KV pool's size in GiB (kv_page_bytes x the pool's pages)."""
    return kv_page_bytes(cfg, engine) * engine.total_pages / 2 ** 30


def allocate_kv(cfg: ModelConfig, engine: EngineConfig, layout: TPLayout, scales=None
                ) -> KVCache | KVLayers:
    """The engine's page pool: KVLayers for the unrolled decoder (engine.unroll_layers
    resolved), one KVCache of all layers for the scanned one (kv_cache.py says why); on a
    mesh each device allocates only its own kv heads. scales: static FP8 scales (k, v) [L, K]
    (kv_calibration.py), or None."""
    form = KVLayers if engine.unroll_layers else KVCache
    alloc = functools.partial(form.allocate, cfg.num_layers, cfg.num_kv_heads,
                              engine.total_pages, engine.page_size, cfg.head_dim,
                              kv_dtype_for(engine), scales=scales)
    if layout.mesh is None:
        return alloc()
    return jax.jit(alloc, out_shardings=layout.named(kv_spec(layout)))()
