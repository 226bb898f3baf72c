"""Static FP8 KV scales (EngineConfig.kv_scales = "static"): one scale per layer and kv head for
K and one for V, calibrated when the runner starts (kv_cache.py says what the kernels gain).

Calibration: one forward of CALIBRATION_TOKENS pseudo-random token ids (a fixed seed, so the
same weights give the same scales at every start) through the model itself, with an
unquantized cache in the activations' dtype, through the runner's own teacher-forcing
program (its attention; the logits it also computes are dropped); each layer's and kv
head's amax of the K (after RoPE, as the cache holds it) and V written there, times HEADROOM,
is mapped to e4m3's 448. Values past it saturate at +-448 (pallas_kernels/kv_pages.py's
quantize_static).

Why random ids and a headroom of 4: on SmolLM2, real text's per-head amax (the pydoc_data
text tests/test_fp8_quality.py scores) exceeded the random ids' by at most 1.64x for K and
2.08x for V; standard-library docstrings (checkpoints/calibrate.py's text) did only a little
better and need a tokenizer the runner does not have. RoPE can also lift an element of a
rotating pair up to the pair's norm (up to sqrt 2) at positions the calibration did not reach.
Headroom costs e4m3 (a float: 3 mantissa bits at any magnitude in its normal range) nothing
but the bottom of that range: elements under ~1.4e-4 of the head's amax (2^-6 codes at this
scale) go subnormal and lose mantissa bits, and they weigh next to nothing in q.k or p.v.
Headroom 1 saturates; 2 to 32 score alike, close to per-token scales (docs/performance.md).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv_cache import (KVCache, KVLayers, allocate_kv, kv_dtype_for,
                               single_sequence_metadata)
from pallas_kernels import FP8_DTYPE, FP8_MAX

CALIBRATION_TOKENS = 512
HEADROOM = 4.0
SEED = 0


def calibration_ids(vocab_size: int, n: int = CALIBRATION_TOKENS) -> np.ndarray:
    """The calibration forward's token ids: n pseudo-random ids, the same every call."""
    return np.random.default_rng(SEED).integers(0, vocab_size, n).astype(np.int32)


def head_amax(kv: KVCache | KVLayers) -> tuple[jax.Array, jax.Array]:
    """Each layer's and kv head's largest |K| and |V| in the cache: ([L, K], [L, K]) f32."""
    caches = kv.layers if isinstance(kv, KVLayers) else (kv,)

    def amax(x):
        return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(2, 3, 4))

    return (jnp.concatenate([amax(c.k) for c in caches]),
            jnp.concatenate([amax(c.v) for c in caches]))


def scales_from_amax(amax) -> np.ndarray:
    """Static scales from calibrated amax: amax x HEADROOM maps to 448 (a zero amax, a head
    that wrote only zeros, gets a tiny positive scale, so its codes are zeros)."""
    return (np.maximum(np.asarray(amax, np.float32) * HEADROOM, 1e-12) / FP8_MAX
            ).astype(np.float32)


def calibrate(forward, allocate, vocab_size: int, page_size: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """(k_scale, v_scale) [L, K] f32. forward(kv, tokens, md) -> the cache after the model
    wrote the tokens' K/V; allocate(num_pages) -> an empty unquantized cache of that many
    pages (page 0 reserved, as the pool's), laid out as the model wants it."""
    ids = calibration_ids(vocab_size)
    pages = -(-len(ids) // page_size)
    md = single_sequence_metadata(np.arange(len(ids)), np.arange(1, pages + 1), page_size,
                                  pages)
    kv = forward(allocate(pages + 1), jnp.asarray(ids), md)
    k_amax, v_amax = jax.device_get(head_amax(kv))
    return scales_from_amax(k_amax), scales_from_amax(v_amax)


def needs_scales(engine) -> bool:
    """The engine's pool is FP8 with static scales: they are calibrated when it starts."""
    return kv_dtype_for(engine) == FP8_DTYPE and engine.kv_scales == "static"


def placeholder_scales(cfg) -> tuple[np.ndarray, np.ndarray]:
    """Scales (k, v) [L, K] of 1 that stand in for the calibrated ones until they are known
    (the pool's shapes do not depend on the values)."""
    ones = np.ones((cfg.num_layers, cfg.num_kv_heads), np.float32)
    return ones, ones


def with_scales(kv: KVCache | KVLayers, scales) -> KVCache | KVLayers:
    """`kv` with its static scales replaced by `scales` (k, v) [L, K], each placed as the
    scale it replaces (device and sharding); the pages are untouched."""
    def put(old, new):
        return jax.device_put(np.asarray(new, np.float32), old.sharding)

    k, v = scales
    if isinstance(kv, KVLayers):
        return KVLayers(tuple(
            dataclasses.replace(c, k_scale=put(c.k_scale, k[i:i + 1]),
                                v_scale=put(c.v_scale, v[i:i + 1]))
            for i, c in enumerate(kv.layers)))
    return dataclasses.replace(kv, k_scale=put(kv.k_scale, k), v_scale=put(kv.v_scale, v))


def engine_scales(cfg, engine, layout, forward):
    """The engine's static scales (k, v) [L, K], or None when its pool is not FP8 with static
    scales. forward(kv, tokens, md) -> kv: the runner's teacher-forcing executable (the
    model's forward and logits; the calibration cache is laid out as the pool is, in the
    activations' dtype)."""
    if not needs_scales(engine):
        return None

    def allocate(pages):
        return allocate_kv(cfg, engine.replace(kv_dtype="auto", num_pages=pages), layout)

    return calibrate(forward, allocate, cfg.vocab_size, engine.page_size)


class CalibratedPool:
    """ModelRunner's page pool with its static FP8 scales (a mixin: it reads the runner's
    config and layout). The pool comes at once with placeholder scales, and the calibration
    runs on a thread of its own, beside the warm-up, so loading no longer waits for its
    forward's compile (the cold start as a whole is bound by the compile work:
    docs/performance.md); the calibrated scales replace the placeholders before the pool is
    first used (`kv`). On several processes it runs before the pool is allocated: its
    collectives must keep their order across processes."""

    def _start_calibration(self, cfg, forward):
        """Start calibrating the static scales (forward: engine_scales'); returns the scales
        to allocate the pool with: placeholders while the thread runs, the calibrated ones on
        several processes, None when the pool has no static scales."""
        self._scales, self._calibration = None, None
        self._calibration_lock = threading.Lock()
        if not needs_scales(self.engine):
            return None

        def calibrate():
            return engine_scales(cfg, self.engine, self.layout, forward)
        if jax.process_count() > 1:
            self._scales = calibrate()
            return self._scales
        pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="jaxinfer-kv-calibration")
        self._calibration = pool.submit(calibrate)
        pool.shutdown(wait=False)     # its thread ends with the calibration
        return placeholder_scales(cfg)

    @property
    def kv(self) -> KVCache | KVLayers:
        """The page pool (its static FP8 scales calibrated: this waits for the calibration
        the first time)."""
        if self._calibration is not None:
            self._install_scales()
        return self._kv

    @kv.setter
    def kv(self, kv: KVCache | KVLayers) -> None:
        if self._calibration is not None:
            self._install_scales()
        self._kv = kv

    @property
    def static_kv_scales(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(k, v) [L, K] f32 of FP8 KV with static scales, else None."""
        if self._calibration is not None:
            self._install_scales()
        return self._scales

    def _install_scales(self) -> None:
        """The calibration's scales (waiting for it; raising what it raised) into the pool,
        in place of the placeholders."""
        with self._calibration_lock:
            if self._calibration is None:      # another thread installed them
                return
            self._scales = self._calibration.result()
            self._kv = with_scales(self._kv, self._scales)
            self._calibration = None
