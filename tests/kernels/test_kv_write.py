"""The K/V write kernel (pallas_kernels/kv_write.py) against XLA's scatter
(pallas_kernels/kv_pages.py's write_kv): interpret mode on the CPU; the gpu-marked cases run the
Triton kernel and check that the cache is updated in place (no copy in the compiled HLO)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer import ops
from jaxinfer.config import EngineConfig
from jaxinfer.routes import Routes
from pallas_kernels import kv_write as kw
from pallas_kernels.kv_pages import FP8_DTYPE, KVCache, write_kv

ON_GPU = jax.default_backend() == "gpu"
PALLAS = Routes.choose(EngineConfig(attention_impl="pallas"), jax.default_backend())


STATIC = "fp8_static"   # FP8 KV with static per-(layer, kv head) scales


def stale_cache(rng, layers, kv_heads, pages, page_size, head_dim, dtype,
                static_range=(0.01, 0.05), token_scales=1.0):
    """A cache with stale contents (uniform in [-2, 2]), so a write that lands in the wrong
    place or misses one shows. STATIC: FP8 with static scales from `static_range`; FP8 with
    per-token scales: those stale too, times `token_scales` (their sign dropped unless 1)."""
    scales = None
    if dtype == STATIC:
        dtype = FP8_DTYPE
        scales = tuple(rng.uniform(*static_range, (layers, kv_heads)) for _ in range(2))
    cache = KVCache.allocate(layers, kv_heads, pages, page_size, head_dim, dtype, scales)

    def stale(x, factor=1.0):
        y = jnp.asarray(rng.uniform(-2, 2, x.shape), jnp.float32)
        return (y if factor == 1.0 else jnp.abs(y) * factor).astype(x.dtype)
    return dataclasses.replace(
        cache, k=stale(cache.k), v=stale(cache.v),
        **({} if scales is not None or cache.k_scale is None else
           dict(k_scale=stale(cache.k_scale, token_scales),
                v_scale=stale(cache.v_scale, token_scales))))


def _case(rng, kv_heads, head_dim, dtype, tokens, layers=2, pages=12, page_size=16):
    """A cache with stale contents, new K/V and slots. STATIC: FP8 with static scales small
    enough that some of the new K values (|k| up to ~100) saturate at +-448 codes."""
    cache = stale_cache(rng, layers, kv_heads, pages, page_size, head_dim, dtype)
    k = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim))
                    * rng.uniform(0.01, 30, (tokens, kv_heads, 1)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), jnp.bfloat16)
    slots = rng.choice(np.arange(page_size, pages * page_size), tokens, replace=False)
    slots[rng.random(tokens) < 0.25] = -1                                  # padding tokens
    k = k.at[0, 0].set(0.0)                                                # an all-zero row
    return cache, k, v, jnp.asarray(slots, jnp.int32)


def _equal(a: KVCache, b: KVCache, exact: bool):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32))
        if exact:
            np.testing.assert_array_equal(x, y)
        else:   # the GPU's division may round a code the other way on a boundary
            np.testing.assert_allclose(x, y, rtol=0.13, atol=1e-6)   # one e4m3 step
            assert np.mean(x != y) < 1e-3


@pytest.mark.parametrize("kv_heads,head_dim,dtype,tokens", [
    (8, 128, FP8_DTYPE, 7), (3, 64, FP8_DTYPE, 5), (3, 64, jnp.bfloat16, 6),
    (4, 32, jnp.float32, 4), (1, 16, FP8_DTYPE, 3), (8, 128, STATIC, 6), (3, 64, STATIC, 5)])
def test_kernel_matches_scatter(kv_heads, head_dim, dtype, tokens):
    rng = np.random.default_rng(kv_heads * 100 + head_dim + tokens)
    cache, k, v, slots = _case(rng, kv_heads, head_dim, dtype, tokens)
    for layer in (0, 1):
        want = write_kv(cache, jnp.int32(layer), k, v, slots)
        got = kw.write_kv(cache, jnp.int32(layer), k, v, slots, interpret=not ON_GPU)
        _equal(got, want, exact=not ON_GPU)
        if dtype == STATIC:   # the scales stay; values past them saturate (not NaN)
            np.testing.assert_array_equal(np.asarray(got.k_scale), np.asarray(cache.k_scale))
            codes = np.abs(np.asarray(got.k[layer].astype(jnp.float32)))
            assert np.isfinite(codes).all() and (codes == 448).any()


def test_static_quantization_matches_numpy():
    """The reference write's static codes: round(x / scale) in e4m3, clipped at +-448."""
    rng = np.random.default_rng(5)
    cache, k, v, slots = _case(rng, 3, 64, STATIC, 6)
    got = write_kv(cache, jnp.int32(1), k, v, slots)
    s = np.asarray(cache.k_scale)[1]
    for t in np.flatnonzero(np.asarray(slots) >= 0):
        page, slot = divmod(int(slots[t]), 16)
        want = np.clip(np.asarray(k[t], np.float32) / s[:, None], -448, 448)
        want = want.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(got.k[1, :, page, slot], np.float32), want)


def test_ops_route_and_errors():
    cache, k, v, slots = _case(np.random.default_rng(1), 2, 64, FP8_DTYPE, 4)
    want = write_kv(cache, jnp.int32(1), k, v, slots)
    _equal(ops.write_kv(cache, jnp.int32(1), k, v, slots, PALLAS), want, exact=not ON_GPU)
    _equal(ops.write_kv(cache, jnp.int32(1), k, v, slots, Routes()), want, exact=True)
    assert not kw.supported(KVCache.allocate(1, 2, 4, 16, 48, jnp.bfloat16))
    with pytest.raises(ValueError, match="slot_mapping"):
        kw.write_kv(cache, jnp.int32(0), k, v, slots[:3], interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8_DTYPE, jnp.bfloat16, STATIC])
def test_gpu_8b_shape_in_place(dtype):
    """Llama-3-8B's kv heads at the throughput run's 256 decode rows; inside a jit that owns
    the (donated) cache the kernel's aliased outputs must not cost a copy of the cache."""
    rng = np.random.default_rng(3)
    cache, k, v, slots = _case(rng, 8, 128, dtype, 256, layers=2, pages=64)
    _equal(kw.write_kv(cache, jnp.int32(1), k, v, slots),
           write_kv(cache, jnp.int32(1), k, v, slots), exact=False)
    step = jax.jit(lambda c, k, v, s: ops.write_kv(c, jnp.int32(1), k, v, s, PALLAS),
                   donate_argnums=0)
    hlo = step.lower(cache, k, v, slots).compile().as_text()
    assert "jaxinfer_kv_write" in hlo or "__gpu$xla.gpu.triton" in hlo
    shape = re.escape(",".join(map(str, cache.k.shape)))
    assert not re.search(rf"\[{shape}\][^\n]*\bcopy\(", hlo), "the cache was copied"


def _rope_case(rng, num_heads, kv_heads, head_dim, dtype, tokens):
    cache, _, _, slots = _case(rng, kv_heads, head_dim, dtype, tokens, pages=2 + tokens // 8)
    width = (num_heads + 2 * kv_heads) * head_dim
    qkv = jnp.asarray(rng.standard_normal((tokens, width)) * rng.uniform(0.01, 30, (tokens, 1)),
                      jnp.bfloat16)
    pos = rng.integers(0, 4096, tokens)
    inv = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim))
    freqs = jnp.asarray(pos[:, None] * inv[None, :], jnp.float32)
    return cache, qkv, jnp.cos(freqs), jnp.sin(freqs), slots


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,dtype,tokens,bias", [
    (32, 8, 128, FP8_DTYPE, 7, False), (32, 8, 128, jnp.bfloat16, 5, False),
    (9, 3, 64, jnp.bfloat16, 6, False), (9, 3, 64, FP8_DTYPE, 4, False),
    (4, 4, 32, jnp.float32, 3, False), (40, 8, 128, FP8_DTYPE, 5, True),
    (9, 3, 64, jnp.bfloat16, 4, True), (32, 8, 128, STATIC, 5, False)])
def test_rope_kernel_matches_reference(num_heads, kv_heads, head_dim, dtype, tokens, bias):
    """RoPE + K/V write in one kernel against rope.apply_rope + XLA's scatter: the cache
    (codes, scales, untouched slots) and the rotated q; padding tokens (slot -1) write
    nothing but still get their q. q differs by at most one bf16 rounding (the kernel's f32
    products may be fused differently). With a QKV bias (Qwen2's heads: 40 q, 8 kv) added
    in the kernel, against the reference adding it to qkv first."""
    rng = np.random.default_rng(num_heads * 1000 + kv_heads * 100 + head_dim + tokens)
    cache, qkv, cos, sin, slots = _rope_case(rng, num_heads, kv_heads, head_dim, dtype, tokens)
    b = (jnp.asarray(rng.standard_normal(qkv.shape[1]) * 3, jnp.float32) if bias else None)
    for layer in (0, 1):
        want_cache, want_q = kw.rope_write_kv_reference(cache, jnp.int32(layer), qkv, cos, sin,
                                                        slots, num_heads=num_heads, bias=b)
        got_cache, got_q = kw.rope_write_kv(cache, jnp.int32(layer), qkv, cos, sin, slots,
                                            num_heads=num_heads, bias=b, interpret=not ON_GPU)
        assert got_q.shape == (tokens, num_heads, head_dim) and got_q.dtype == qkv.dtype
        np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32),
                                   rtol=2 ** -7, atol=1e-6)
        _equal(got_cache, want_cache, exact=False)


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,dtype,bias", [
    (32, 8, 128, FP8_DTYPE, False), (9, 3, 64, jnp.bfloat16, True),
    (32, 8, 128, STATIC, True)])
def test_rope_kernel_applies_product_scales(num_heads, kv_heads, head_dim, dtype, bias):
    """An unscaled FP8 tensor-core product with its per-token and per-channel scales (the
    fused FP8 layer's QKV): the kernel applies them (and the bias after them) as
    fp8_matmul.tc_scaled and the Linear do, against the reference scaling qkv first."""
    rng = np.random.default_rng(num_heads + head_dim)
    cache, qkv, cos, sin, slots = _rope_case(rng, num_heads, kv_heads, head_dim, dtype, 6)
    product = jnp.asarray(np.asarray(qkv, np.float32) * 300, jnp.bfloat16)  # codes' scale
    scales = (jnp.asarray(rng.uniform(0.5, 2, (6, 1)) / 300, jnp.float32),
              jnp.asarray(rng.uniform(0.5, 2, qkv.shape[1]), jnp.float32))
    b = (jnp.asarray(rng.standard_normal(qkv.shape[1]), jnp.float32) if bias else None)
    want_cache, want_q = kw.rope_write_kv_reference(cache, jnp.int32(1), product, cos, sin,
                                                    slots, num_heads=num_heads, bias=b,
                                                    scales=scales)
    got_cache, got_q = kw.rope_write_kv(cache, jnp.int32(1), product, cos, sin, slots,
                                        num_heads=num_heads, bias=b, scales=scales,
                                        interpret=not ON_GPU)
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32),
                               rtol=2 ** -7, atol=1e-6)
    _equal(got_cache, want_cache, exact=False)
    unscaled = kw.rope_write_kv_reference(cache, jnp.int32(1), product, cos, sin, slots,
                                          num_heads=num_heads, bias=b)[1]
    assert not np.allclose(np.asarray(unscaled, np.float32), np.asarray(want_q, np.float32))
    with pytest.raises(ValueError, match="scales"):
        kw.rope_write_kv(cache, jnp.int32(0), product, cos, sin, slots, num_heads=num_heads,
                         scales=(scales[0][:-1], scales[1]), interpret=True)


def test_rope_route_and_errors():
    rng = np.random.default_rng(5)
    cache, qkv, cos, sin, slots = _rope_case(rng, 4, 2, 64, jnp.bfloat16, 4)
    got = ops.rope_write_kv(cache, jnp.int32(1), qkv, cos, sin, slots, num_heads=4,
                            routes=PALLAS)
    want_cache, want_q = kw.rope_write_kv_reference(cache, jnp.int32(1), qkv, cos, sin, slots,
                                                    num_heads=4)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want_q, np.float32),
                               rtol=2 ** -7)
    _equal(got[1], want_cache, exact=False)
    assert ops.rope_write_kv(cache, jnp.int32(1), qkv, cos, sin, slots, num_heads=4,
                             routes=Routes()) is None
    assert ops.rope_write_kv(KVCache.allocate(1, 2, 4, 16, 48, jnp.bfloat16), jnp.int32(0),
                             qkv, cos, sin, slots, num_heads=4, routes=PALLAS) is None
    with pytest.raises(ValueError, match="rope_write_kv"):
        kw.rope_write_kv(cache, jnp.int32(0), qkv[:, :-64], cos, sin, slots, num_heads=4,
                         interpret=True)
    with pytest.raises(ValueError, match="bias"):
        kw.rope_write_kv(cache, jnp.int32(0), qkv, cos, sin, slots, num_heads=4,
                         bias=jnp.zeros(qkv.shape[1] - 1), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP8_DTYPE, jnp.bfloat16])
@pytest.mark.parametrize("tokens", [8, 256])
@pytest.mark.parametrize("num_heads,bias", [(32, False), (40, True)])
def test_gpu_rope_8b_shape(dtype, tokens, num_heads, bias):
    """Llama-3-8B's heads (32 q, 8 kv, D 128; and Qwen2.5-32B's 40 q with the QKV bias)
    compiled on the H200, batch-1 (8 padded rows) and 256-row decode steps; in place inside
    a jit that owns the cache."""
    rng = np.random.default_rng(tokens)
    cache, qkv, cos, sin, slots = _rope_case(rng, num_heads, 8, 128, dtype, tokens)
    b = jnp.asarray(rng.standard_normal(qkv.shape[1]), jnp.bfloat16) if bias else None
    want_cache, want_q = kw.rope_write_kv_reference(cache, jnp.int32(1), qkv, cos, sin, slots,
                                                    num_heads=num_heads, bias=b)
    got_cache, got_q = kw.rope_write_kv(cache, jnp.int32(1), qkv, cos, sin, slots,
                                        num_heads=num_heads, bias=b)
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32),
                               rtol=2 ** -7, atol=1e-6)
    _equal(got_cache, want_cache, exact=False)
    step = jax.jit(lambda c, x: ops.rope_write_kv(c, jnp.int32(1), x, cos, sin, slots,
                                                  num_heads=num_heads, routes=PALLAS, bias=b),
                   donate_argnums=0)
    hlo = step.lower(cache, qkv).compile().as_text()
    shape = re.escape(",".join(map(str, cache.k.shape)))
    assert not re.search(rf"\[{shape}\][^\n]*\bcopy\(", hlo), "the cache was copied"
