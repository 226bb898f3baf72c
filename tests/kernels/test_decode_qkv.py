"""The decode kernel's fused front (pallas_kernels/decode_qkv.py) against the unfused route:
the projection from its partials (ops.linear's rounding), kv_write's RoPE + K/V write
reference and the paged-attention reference. Interpret mode on the CPU; the gpu-marked cases
run the Triton kernel (JAXINFER_TEST_GPU=1 -m gpu).

Each case's rows cover the length classes that matter to the fold: a first token (nothing
cached), a new token opening a page, one closing a page, one opening a split, one deep in a
split (or the table's last slot), and a padded row (seq_len 0, slot -1). The cache starts
with stale contents, so a slot read before its write or a write in the wrong place shows;
its other slots must come back unchanged. Tolerance as tests/kernels/test_paged_attention.py
(relative L2 1e-2; the cache to one e4m3 step, as tests/kernels/test_kv_write.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_pages import FP8_DTYPE, KVCache
from pallas_kernels import decode_qkv as dq
from pallas_kernels import kv_write as kw
from pallas_kernels.fp8_matmul import fp8_linear_reference
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.tuning import DecodeBlocks
from test_kv_write import STATIC, stale_cache

MODES = [pytest.param(True, id="interpret"),
         pytest.param(False, id="gpu", marks=pytest.mark.gpu)]
PAGES_PER_SEQ, LAYERS = 8, 2


def rms_normed(x, w, eps):
    """RMSNorm(x) * w in x's dtype (model.RMSNorm's math: f32, rounded once)."""
    xf = x.astype(jnp.float32)
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (n * w.astype(jnp.float32)).astype(x.dtype)


def make_case(seed, num_heads, kv_heads, head_dim, dtype, page_size, split_tokens, fp8_w,
              bias, hidden=128):
    """-> (partials, w scale, bias, cos, sin, cache, seq_lens, page table, slots, rows)."""
    rng = np.random.default_rng(seed)
    cap = PAGES_PER_SEQ * page_size
    lens = [1, page_size + 1, 2 * page_size, min(split_tokens + 1, cap),
            min(3 * split_tokens - 5, cap), 0]
    t = len(lens)
    pages = 1 + t * PAGES_PER_SEQ
    table = (1 + rng.permutation(pages - 1)[:t * PAGES_PER_SEQ]).reshape(t, -1)
    table[-1] = 0
    cache = stale_cache(rng, LAYERS, kv_heads, pages, page_size, head_dim, dtype,
                        static_range=(0.005, 0.02), token_scales=0.01)
    pos = np.maximum(np.asarray(lens) - 1, 0)
    slots = np.where(np.asarray(lens) > 0,
                     table[np.arange(t), pos // page_size] * page_size + pos % page_size, -1)
    width = (num_heads + 2 * kv_heads) * head_dim
    x = jnp.asarray(rng.standard_normal((t, hidden)), jnp.bfloat16)
    if fp8_w:
        w = jnp.asarray(rng.uniform(-448, 448, (width, hidden)), jnp.float32).astype(FP8_DTYPE)
        scale = jnp.asarray(rng.uniform(0.5, 2, width) / 448 / np.sqrt(hidden) * 4,
                            jnp.float32)
    else:
        w = jnp.asarray(rng.standard_normal((hidden, width)) * 4 / np.sqrt(hidden),
                        jnp.bfloat16)
        scale = None
    b = jnp.asarray(rng.standard_normal(width), jnp.bfloat16) if bias else None
    inv = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim))
    freqs = jnp.asarray(pos[:, None] * inv[None, :], jnp.float32)
    partials = dq.partial_products(x, w, 4)
    return (partials, scale, b, jnp.cos(freqs), jnp.sin(freqs), cache,
            jnp.asarray(lens, jnp.int32), jnp.asarray(table, jnp.int32),
            jnp.asarray(slots, jnp.int32), (x, w))


def unfused(case, num_heads, layer):
    partials, scale, b, cos, sin, cache, lens, table, slots, _ = case
    qkv = dq.projection_reference(partials, scale, jnp.bfloat16)
    cache, q = kw.rope_write_kv_reference(cache, jnp.int32(layer), qkv, cos, sin, slots,
                                          num_heads=num_heads, bias=b)
    out = paged_attention_reference(q, cache.k, cache.v, jnp.int32(layer), lens, table,
                                    cache.k_scale, cache.v_scale, sm_scale=q.shape[-1] ** -0.5)
    return out, cache


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def assert_cache_equal(got: KVCache, want: KVCache):
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        x, y = np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32))
        np.testing.assert_allclose(x, y, rtol=0.13, atol=1e-6)   # one e4m3 step at most
        assert np.mean(x != y) < 1e-3


# (q heads, kv heads, head dim, kv dtype, page size, block tokens, splits, fp8 compute,
#  FP8 weights, bias)
BF, HF = "bfloat16", "float16"
CASES = [
    (8, 2, 64, jnp.bfloat16, 16, 16, 4, BF, True, False),
    (8, 2, 64, jnp.bfloat16, 8, 32, 1, BF, False, True),
    (6, 2, 128, jnp.bfloat16, 16, 32, 2, BF, True, True),
    (8, 2, 64, FP8_DTYPE, 16, 16, 4, BF, True, False),
    (4, 4, 64, FP8_DTYPE, 16, 32, 1, HF, False, False),
    (8, 2, 128, STATIC, 16, 16, 4, HF, True, True),
    (10, 2, 64, STATIC, 8, 16, 2, BF, False, False),
]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,page,tokens,splits,compute,fp8_w,bias",
                         CASES)
def test_fused_front_matches_unfused(heads, kv_heads, head_dim, dtype, page, tokens, splits,
                                     compute, fp8_w, bias, interpret):
    split_tokens = PAGES_PER_SEQ * page // splits
    case = make_case(heads + head_dim + splits, heads, kv_heads, head_dim, dtype, page,
                     split_tokens, fp8_w, bias)
    partials, scale, b, cos, sin, cache, lens, table, slots, _ = case
    blocks = DecodeBlocks(tokens, splits, 4, 2, compute)
    for layer in ((0, 1) if splits == 4 else (1,)):     # the layer's rows: both, in 3 cases
        want_out, want_cache = unfused(case, heads, layer)
        out, got_cache = dq.paged_attention_qkv(
            partials, scale, b, cos, sin, cache, jnp.int32(layer), lens, table, slots,
            num_heads=heads, sm_scale=head_dim ** -0.5, dtype=jnp.bfloat16,
            interpret=interpret, blocks=blocks)
        assert out.shape == (len(lens), heads, head_dim) and out.dtype == jnp.bfloat16
        assert rel_err(out, want_out) < 1e-2
        np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0)  # the padded row
        assert_cache_equal(got_cache, want_cache)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8_DTYPE])
def test_masked_loads_match_unfused(dtype, interpret):
    """The tail blocks read with masked loads (the form grids of >= 2048 programs take), K
    as two masked half-rows: the same results."""
    case = make_case(11, 8, 2, 128, dtype, 16, 32, True, True)
    partials, scale, b, cos, sin, cache, lens, table, slots, _ = case
    want_out, want_cache = unfused(case, 8, 0)
    out, got_cache = dq.paged_attention_qkv(
        partials, scale, b, cos, sin, cache, jnp.int32(0), lens, table, slots, num_heads=8,
        sm_scale=128 ** -0.5, dtype=jnp.bfloat16, interpret=interpret, masked_loads=True,
        blocks=DecodeBlocks(32, 4, 4, 2))
    assert rel_err(out, want_out) < 1e-2
    assert_cache_equal(got_cache, want_cache)


def test_real_rows_only_and_errors():
    """`rows`: the grid covers the real rows (split) and the padding rows come back zero;
    bad shapes and f16pairs blocks raise."""
    case = make_case(3, 8, 2, 64, jnp.bfloat16, 16, 32, True, False)
    partials, scale, b, cos, sin, cache, lens, table, slots, _ = case
    want_out, want_cache = unfused(case, 8, 1)
    kw_args = dict(num_heads=8, sm_scale=0.125, dtype=jnp.bfloat16, interpret=True)
    out, got_cache = dq.paged_attention_qkv(partials, scale, b, cos, sin, cache, jnp.int32(1),
                                            lens, table, slots, rows=5,
                                            blocks=DecodeBlocks(16, 4, 4, 2), **kw_args)
    assert rel_err(out, want_out) < 1e-2
    assert_cache_equal(got_cache, want_cache)
    with pytest.raises(ValueError, match="partials"):
        dq.paged_attention_qkv(partials[:, :, :-64], scale, b, cos, sin, cache, jnp.int32(1),
                               lens, table, slots, **kw_args)
    fp8 = KVCache.allocate(LAYERS, 2, cache.k.shape[2], 16, 64, FP8_DTYPE)
    with pytest.raises(ValueError, match="plain rows"):
        dq.paged_attention_qkv(partials, scale, b, cos, sin, fp8, jnp.int32(1), lens, table,
                               slots, blocks=DecodeBlocks(16, 1, 4, 2, "f16pairs"), **kw_args)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [FP8_DTYPE, STATIC])
def test_table_blocks_read_fp8_kv_as_plain_rows(dtype, interpret):
    """FP8 KV at head dim 128, where the decode table reads byte pairs (f16pairs): the front
    takes the table's blocks with plain f16-widened rows (front_blocks) and matches the
    unfused route."""
    from pallas_kernels import tuning
    chosen = tuning.decode_blocks(1, 2, 128, 16, 1, 128)
    assert chosen.fp8_compute == "f16pairs"
    assert dq.front_blocks(chosen, FP8_DTYPE, 128) == DecodeBlocks(
        chosen.block_tokens, chosen.num_splits, chosen.num_warps, chosen.num_stages, HF,
        chosen.prefetch_table)
    assert dq.front_blocks(chosen, jnp.bfloat16, 128) == chosen
    case = make_case(5, 8, 2, 128, dtype, 16, 64, True, True)
    partials, scale, b, cos, sin, cache, lens, table, slots, _ = case
    want_out, want_cache = unfused(case, 8, 1)
    out, got_cache = dq.paged_attention_qkv(
        partials, scale, b, cos, sin, cache, jnp.int32(1), lens, table, slots, num_heads=8,
        sm_scale=128 ** -0.5, dtype=jnp.bfloat16, interpret=interpret)
    assert rel_err(out, want_out) < 1e-2
    assert_cache_equal(got_cache, want_cache)


@pytest.mark.parametrize("fp8_w", [True, False])
def test_partial_products_sum_to_the_projection(fp8_w):
    """The S partial products summed (and scaled) are the linear's product."""
    case = make_case(7, 8, 2, 64, jnp.bfloat16, 16, 32, fp8_w, False)
    partials, scale, (x, w) = case[0], case[1], case[-1]
    got = np.asarray(dq.projection_reference(partials, scale, jnp.float32))
    if fp8_w:
        want = np.asarray(fp8_linear_reference(x.astype(jnp.float32), w, scale))
    else:
        want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="multiple"):
        dq.partial_products(x[:, :-1], w, 4)


def written_and_rest(cache: KVCache, layer: int, slots):
    """(the new tokens' K and V rows of `layer` [K, n, D] f32 each, every other entry of both
    caches with those rows zeroed)."""
    s = np.asarray(slots)
    s = s[s >= 0]
    page_size = cache.k.shape[3]
    pages, offs = s // page_size, s % page_size
    new, rest = [], []
    for c in (cache.k, cache.v):
        c = np.array(c.astype(jnp.float32))
        new.append(c[layer][:, pages, offs].copy())
        c[layer][:, pages, offs] = 0
        rest.append(c)
    return new, rest


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("hidden,dtype,fp8_w", [(128, jnp.bfloat16, True), (96, STATIC, False)])
def test_folded_norm_matches_normed_rows(hidden, dtype, fp8_w, interpret):
    """The RMSNorm before QKV folded into the front (norm_eps): the partials are products of
    x times the norm's weight and the kernel scales each row's sum by 1 / rms(x), reading x
    in chunks (96 = 3 x 32). The unfused route from the normed rows rounds them to bf16
    before its product, the fold rounds x * weight instead, so the two differ by roundings:
    both are held to the route from exact (f32) normed rows within 2e-2 relative L2 (each
    lands at ~0.3-1.3% on these cases: the softmax of this random data is peaked, so one
    rounding moves the output by up to ~1%). Every other cache entry is untouched, and
    without the factor the output is far off."""
    case = make_case(13, 8, 2, 64, dtype, 16, 32, fp8_w, True, hidden=hidden)
    _, scale, b, cos, sin, cache, lens, table, slots, (_, w) = case
    rng = np.random.default_rng(14)
    x = jnp.asarray(rng.standard_normal((len(lens), hidden)) * 3, jnp.bfloat16)
    g = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.bfloat16)
    xf = x.astype(jnp.float32)
    exact = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + 1e-5) * g
    wf = w.astype(jnp.float32)                 # FP8 [N, E] or [E, N]: f32 products of exact
    exact = jnp.einsum("te,ne->tn" if fp8_w else "te,en->tn", exact, wf,
                       precision=jax.lax.Precision.HIGHEST)[None]
    routes = [unfused((p,) + case[1:], 8, 1) for p in
              (exact, dq.partial_products(rms_normed(x, g, 1e-5), w, 4))]
    u = (xf * g.astype(jnp.float32)).astype(x.dtype)
    args = (dq.partial_products(u, w, 4), scale, b, cos, sin, cache, jnp.int32(1), lens,
            table, slots)
    kw_args = dict(num_heads=8, sm_scale=0.125, dtype=jnp.bfloat16, interpret=interpret,
                   blocks=DecodeBlocks(16, 4, 4, 2))
    routes.append(dq.paged_attention_qkv(*args, x=x, norm_eps=1e-5, **kw_args))
    (want, want_cache), (plain, plain_cache), (out, got) = routes
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0)   # the padded row
    new_want, rest_want = written_and_rest(want_cache, 1, slots)
    new_plain, _ = written_and_rest(plain_cache, 1, slots)
    new_got, rest = written_and_rest(got, 1, slots)
    for a, a_plain, a_want in [(out, plain, want)] + list(zip(new_got, new_plain, new_want)):
        assert rel_err(a_plain, a_want) < 2e-2 and rel_err(a, a_want) < 2e-2
    for r, r_want in zip(rest, rest_want):
        np.testing.assert_array_equal(r, r_want)
    bare, _ = dq.paged_attention_qkv(*args, **kw_args)
    assert rel_err(bare, want) > 0.5
    with pytest.raises(ValueError, match="norm_eps"):
        dq.paged_attention_qkv(*args, x=x[:-1], norm_eps=1e-5, **kw_args)
