"""Decode paged attention: Pallas kernel vs its plain-jnp reference on fresh random caches.

The grid samples page size x GQA ratio x head dim x KV dtype x block config; every case's
batch holds the length classes 1, one page, page -1, page +1, a random length, the full
table (several blocks, several splits) and a padded row (seq_len 0). Interpret mode on the
CPU; the same cases marked gpu run compiled on the H200 (JAXINFER_TEST_GPU=1 -m gpu).

Tolerance, relative L2 (‖out-ref‖/‖ref‖): 1e-2 for bf16 and FP8 KV. The reference reads the
same quantized FP8 cache in f32; e4m3 widens to bf16 and f16 exactly, so the kernel's only
extra rounding is q and p in the compute dtype for the tensor cores (bf16 ~2^-9, f16 ~2^-12
relative) and the bf16 output, the same as for bf16 KV. FP8 cases run each compute choice
(DecodeBlocks.fp8_compute; f16pairs, the f16 numerics on K/V read as byte pairs, is the
decode default at head dim 128). "fp8s" cases carry static scales, one per layer and kv head
(the engine's default form; each head at its own K and V magnitude), at the same tolerance:
the kernel applies them once per program, the reference per element. The scale stress cases
(per-token magnitudes 1e-3..1e3, e4m3 values at 448, |q| from 1e-6 to 2e5) use f32 q, so the
output is not rounded to bf16, and check every sequence's own relative error: the f16 path <
4e-3 (it reaches ~3e-4 on them; without its max-scale normalization of p * v_scale the
wide-V cases give ~7e-3, and q clipped to f16's range instead of normalized gives ~1e3 at
|q| = 2e5 and ~1.2e-2 at 1e-6; bf16 widening ~2.3e-3). What FP8 costs against unquantized KV
(3 mantissa bits, ~2^-4 per element, averaged over the context) is checked separately at
8e-2.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_pages import FP8_DTYPE, quantize_fp8, quantize_static
from pallas_kernels.paged_attention import (paged_attention, paged_attention_blocks,
                                            paged_attention_reference)
from pallas_kernels.tuning import DecodeBlocks

KV_HEADS, LAYERS, PAGES_PER_SEQ = 2, 2, 9
MODES = [pytest.param(True, id="interpret"),
         pytest.param(False, id="gpu", marks=pytest.mark.gpu)]


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def row_rel_err(out, ref):
    """The largest per-sequence (first axis) relative error, rows whose reference is all
    zeros (padding) skipped: one global norm would hide a small row behind a large one."""
    out, ref = (np.asarray(x, np.float32).reshape(x.shape[0], -1) for x in (out, ref))
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    norm = np.linalg.norm(ref, axis=1)
    live = norm > 0
    return np.max(np.linalg.norm(out - ref, axis=1)[live] / norm[live])


def make_cache(rng, page_size, head_dim, kv_dtype, num_pages):
    """Random K/V pages [L, K, P, S, D] (+ per-token-head scales for "fp8"; for "fp8s"
    static per (layer, kv head) ones, each head with its own K and V magnitudes and the
    scale its amax / 448) and the bf16 originals the FP8 pages were quantized from."""
    shape = (LAYERS, KV_HEADS, num_pages, page_size, head_dim)
    static = kv_dtype == "fp8s"
    heads = shape[:2] + (1, 1, 1)
    k_mag = 10.0 ** rng.uniform(-1, 0.5, heads) if static else 1.0
    v_mag = 10.0 ** rng.uniform(-2, 2, heads) if static else 1.0
    k = jnp.asarray(rng.standard_normal(shape) * k_mag, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape) * v_mag, jnp.bfloat16)
    if kv_dtype == "fp8":
        (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
        return (kq, vq, ks, vs), (k, v)
    if static:
        def quant(x):     # kv_pages.quantize_static per (layer, kv head)
            scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(2, 3, 4)) / 448
            codes = [jnp.moveaxis(quantize_static(jnp.moveaxis(x[i], 0, -2), scale[i]), -2, 0)
                     for i in range(LAYERS)]
            return jnp.stack(codes), scale
        (kq, ks), (vq, vs) = quant(k), quant(v)
        return (kq, vq, ks, vs), (k, v)
    dt = jnp.float32 if kv_dtype == "f32" else jnp.bfloat16
    return (k.astype(dt), v.astype(dt), None, None), (k, v)


def stress_cache(rng, q, shape, kind: str, q_mag: float):
    """FP8 pages written directly (every token holds values up to e4m3's max 448) with
    per-token magnitudes spread over 1e-3 .. 1e3, and q scaled by q_mag (K's scales by
    1/q_mag, so logits stay O(1)). "wide_v": q rows are one direction w plus noise and token
    t's K is a_t w with a_t = -ln(|V_t|) + noise, so p_t * |V_t| is of one order for every
    token: small-V tokens carry most of the weight beside huge-V ones in the same block (the
    f16 path's underflow case). "wide_k": random K and q, K magnitudes spread the same way."""
    d = shape[-1]
    mags = 10.0 ** rng.uniform(-3, 3, shape[:-1])                          # [L, K, P, S]
    v8 = rng.uniform(-448, 448, shape)
    vs = mags / 448 if kind == "wide_v" else rng.uniform(0.5, 1.5, shape[:-1]) / 448
    w = np.sign(rng.standard_normal(d))
    if kind == "wide_v":
        a = -np.log(mags) + rng.standard_normal(mags.shape)
        k8 = 448 * np.sign(a)[..., None] * w
        ks = np.abs(a) / np.sqrt(d) / 448
        q = w + 0.3 * rng.standard_normal(q.shape)
    else:
        k8, ks = rng.uniform(-448, 448, shape), 10.0 ** rng.uniform(-3, 3, shape[:-1]) / 448
        q = rng.standard_normal(q.shape)
    fp8 = (jnp.asarray(k8).astype(FP8_DTYPE), jnp.asarray(v8).astype(FP8_DTYPE),
           jnp.asarray(ks / q_mag, jnp.float32), jnp.asarray(vs, jnp.float32))
    return jnp.asarray(q * q_mag, jnp.float32), fp8


def make_decode(seed, page_size, groups, head_dim, kv_dtype):
    """A batch covering every length class; pages drawn without replacement, page 0 kept
    for the padded row's table."""
    rng = np.random.default_rng(seed)
    s = page_size
    lens = [1, s, s - 1, s + 1, int(rng.integers(2, PAGES_PER_SEQ * s)), PAGES_PER_SEQ * s, 0]
    batch = len(lens)
    num_pages = 1 + batch * PAGES_PER_SEQ + 3
    table = (1 + rng.permutation(num_pages - 1)[:batch * PAGES_PER_SEQ]).reshape(batch, -1)
    table[-1] = 0
    cache, originals = make_cache(rng, page_size, head_dim, kv_dtype, num_pages)
    q = jnp.asarray(rng.standard_normal((batch, KV_HEADS * groups, head_dim)), jnp.bfloat16)
    return (q, cache, jnp.asarray(lens, jnp.int32), jnp.asarray(table, jnp.int32),
            originals)


def run_pair(case, interpret, blocks=None, layer=1, longest_first=None):
    q, (k, v, ks, vs), lens, table, _ = case
    scale = q.shape[-1] ** -0.5
    args = (q, k, v, jnp.int32(layer), lens, table, ks, vs)
    if blocks is None:
        out = paged_attention(*args, sm_scale=scale, interpret=interpret)
    else:
        out = paged_attention_blocks(*args, sm_scale=scale, interpret=interpret, blocks=blocks,
                                     longest_first=longest_first)
    return out, paged_attention_reference(*args, sm_scale=scale)


# (page size, q heads per kv head, head dim, kv dtype, block tokens, splits, fp8 compute,
#  page-table prefetch)
BF, HF, PR = "bfloat16", "float16", "f16pairs"
GRID = [
    (8, 1, 64, "bf16", 16, 1, BF, 0), (8, 8, 64, "bf16", 16, 3, BF, 1),
    (16, 1, 128, "fp8", 16, 1, BF, 1), (16, 4, 64, "bf16", 32, 4, BF, 0),
    (16, 8, 128, "bf16", 64, 1, BF, 1), (16, 8, 64, "fp8", 16, 2, HF, 0),
    (32, 4, 128, "bf16", 32, 2, BF, 0), (32, 1, 64, "fp8", 64, 1, BF, 1),
    (32, 8, 128, "fp8", 32, 1, HF, 1), (16, 3, 64, "bf16", 16, 2, BF, 0),
    (8, 4, 64, "f32", 16, 2, BF, 1), (8, 4, 128, "fp8", 32, 2, PR, 1),
    (16, 8, 64, "fp8", 16, 1, PR, 0), (32, 1, 128, "fp8", 64, 3, PR, 1),
    (16, 4, 128, "fp8s", 32, 2, PR, 1), (8, 8, 64, "fp8s", 16, 1, HF, 0),
    (32, 1, 128, "fp8s", 64, 3, BF, 1),
]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("page_size,groups,head_dim,kv_dtype,tokens,splits,compute,prefetch",
                         GRID)
def test_kernel_matches_reference(page_size, groups, head_dim, kv_dtype, tokens, splits,
                                  compute, prefetch, interpret):
    seed = page_size * 1000 + groups * 100 + head_dim + tokens + splits
    case = make_decode(seed, page_size, groups, head_dim, kv_dtype)
    out, ref = run_pair(case, interpret,
                        DecodeBlocks(tokens, splits, 4, 2, compute, bool(prefetch)))
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    assert rel_err(out, ref) < (1e-3 if kv_dtype == "f32" else 1e-2)
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # padded row


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("page_size,groups,head_dim,kv_dtype,tokens,compute",
                         [(8, 1, 64, "bf16", 16, BF), (16, 4, 128, "fp8", 32, PR),
                          (32, 8, 64, "fp8", 32, HF)])
def test_longest_first_matches_reference(page_size, groups, head_dim, kv_dtype, tokens,
                                         compute, interpret):
    """Rows run longest first (grid (K, B, 1), row = the sorted order's rank): every row's
    output is its own. The lengths are shuffled so the order is not the identity."""
    q, cache, lens, table, originals = make_decode(page_size + groups, page_size, groups,
                                                   head_dim, kv_dtype)
    perm = np.random.default_rng(groups).permutation(len(lens))
    assert not np.array_equal(np.argsort(-np.asarray(lens)[perm], kind="stable"),
                              np.arange(len(lens)))
    case = (q[perm], cache, lens[perm], table[perm], originals)
    blocks = DecodeBlocks(tokens, 1, 4, 2, compute, True)
    out, _ = run_pair(case, interpret, blocks)        # 14 programs: grid order (B, K, 1)
    first, ref = run_pair(case, interpret, blocks, longest_first=True)
    k, v, ks, vs = cache
    jaxpr = str(jax.make_jaxpr(functools.partial(
        paged_attention_blocks, sm_scale=1.0, interpret=interpret, blocks=blocks,
        longest_first=True))(case[0], k, v, jnp.int32(1), case[2], case[3], ks, vs))
    assert "sort" in jaxpr and "grid=(2, 7, 1)" in jaxpr      # (K, B, 1)
    np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(out, np.float32))
    assert row_rel_err(first, ref) < 1e-2
    pad = int(np.flatnonzero(np.asarray(case[2]) == 0)[0])
    np.testing.assert_array_equal(np.asarray(first[pad], np.float32), 0.0)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("page_size,groups,head_dim,kv_dtype,tokens,splits,compute",
                         [(8, 4, 64, "bf16", 32, 1, BF), (16, 4, 128, "fp8", 64, 1, PR),
                          (16, 8, 64, "fp8", 32, 2, HF)])
def test_masked_loads_match_reference(page_size, groups, head_dim, kv_dtype, tokens, splits,
                                      compute, interpret):
    """The last, partly filled block read with masked loads (the rule takes them at >= 2048
    programs; forced here) or read and zeroed gives the rows' own attention: every slot past
    a row's length holds NaN (K, V and scales), so one reaching the math would show."""
    q, (k, v, ks, vs), lens, table, _ = make_decode(page_size * groups + tokens, page_size,
                                                    groups, head_dim, kv_dtype)
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q, k, v, jnp.int32(1), lens, table, ks, vs,
                                    sm_scale=scale)
    stale = np.zeros(k.shape[2:4], bool)                      # [pages, slots]
    for n, pages in zip(np.asarray(lens), np.asarray(table)):
        if n > 0:
            stale[pages] = (np.arange(len(pages) * page_size) >= n).reshape(len(pages), -1)
    mask = jnp.asarray(stale)[None, None]
    k, v = (jnp.where(mask[..., None], jnp.asarray(jnp.nan, x.dtype), x) for x in (k, v))
    if ks is not None:
        ks, vs = (jnp.where(mask, jnp.nan, x) for x in (ks, vs))
    blocks = DecodeBlocks(tokens, splits, 4, 2, compute, True)
    for masked in (True, False):
        out = paged_attention_blocks(q, k, v, jnp.int32(1), lens, table, ks, vs, sm_scale=scale,
                                     interpret=interpret, blocks=blocks, masked_loads=masked)
        assert row_rel_err(out, ref) < 1e-2, masked


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_public_entry_uses_tuned_blocks(kv_dtype, interpret):
    case = make_decode(7, 16, 4, 128, kv_dtype)
    out, ref = run_pair(case, interpret, layer=0)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8s"])
def test_one_wave_blocks_match_reference(kv_dtype, interpret):
    from pallas_kernels import tuning
    tokens, warps, stages, compute, prefetch = tuning.ONE_WAVE_TABLE[(1, 128)]
    case = make_decode(17, 16, 4, 128, kv_dtype)
    out, ref = run_pair(case, interpret, DecodeBlocks(tokens, 1, warps, stages, compute,
                                                      prefetch))
    assert rel_err(out, ref) < 1e-2


# (kind, q magnitude, fp8 compute; None = the public entry's tuned blocks)
STRESS = [("wide_v", 1.0, None), ("wide_v", 2e5, HF), ("wide_v", 1e-6, HF), ("wide_k", 1.0, HF),
          ("wide_v", 2e5, BF), ("wide_v", 2e5, PR), ("wide_k", 1e-6, PR)]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kind,q_mag,compute", STRESS)
def test_fp8_scale_stress(kind, q_mag, compute, interpret):
    """FP8 range corners for the f16 path's safeguards (see stress_cache); bf16 widening on
    the same data for comparison (its logits round q to 8 bits: looser bound)."""
    q, (k, _, _, _), lens, table, originals = make_decode(13, 16, 4, 128, "fp8")
    q, cache = stress_cache(np.random.default_rng(17), q, k.shape, kind, q_mag)
    blocks = None if compute is None else DecodeBlocks(32, 2, 4, 2, compute)
    out, ref = run_pair((q, cache, lens, table, originals), interpret, blocks)
    assert row_rel_err(out, ref) < (1e-2 if compute == BF else 4e-3)


@pytest.mark.parametrize("interpret", MODES)
def test_traced_layer_under_scan(interpret):
    """The model scans over layers: the layer index arrives traced."""
    q, (k, v, _, _), lens, table, _ = make_decode(3, 8, 4, 64, "bf16")
    scale = 0.125

    def body(carry, layer):
        out = paged_attention(q, k, v, layer, lens, table, sm_scale=scale,
                              interpret=interpret)
        return carry, out
    _, outs = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(LAYERS)))()
    for layer in range(LAYERS):
        ref = paged_attention_reference(q, k, v, layer, lens, table, sm_scale=scale)
        assert rel_err(outs[layer], ref) < 1e-2


def test_fp8_quantization_error_is_bounded():
    """FP8 against the bf16 KV it was quantized from: the documented e4m3 cost."""
    q, (k, v, ks, vs), lens, table, (k16, v16) = make_decode(11, 16, 4, 128, "fp8")
    scale = 128 ** -0.5
    fp8 = paged_attention_reference(q, k, v, 1, lens, table, ks, vs, sm_scale=scale)
    bf16 = paged_attention_reference(q, k16, v16, 1, lens, table, sm_scale=scale)
    assert 1e-3 < rel_err(fp8, bf16) < 8e-2


def test_bad_shapes_raise():
    q, (k, v, ks, vs), lens, table, _ = make_decode(5, 8, 4, 64, "fp8")
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(q, k, v, 0, lens, table, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(q[:, :3], k, v, 0, lens, table, ks, vs, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="block_tokens"):
        paged_attention_blocks(q, k, v, 0, lens, table, ks, vs, sm_scale=1.0,
                               blocks=DecodeBlocks(8, 1, 4, 2))
    with pytest.raises(ValueError, match="fp8_compute"):
        paged_attention_blocks(q, k, v, 0, lens, table, ks, vs, sm_scale=1.0, interpret=True,
                               blocks=DecodeBlocks(16, 1, 4, 2, "float8"))
    with pytest.raises(ValueError, match="batch"):
        paged_attention(q, k, v, 0, lens[:2], table, ks, vs, sm_scale=1.0, interpret=True)


@pytest.mark.parametrize("unroll,window,sorts", [(False, (1, 1 << 20), 1),
                                                 (True, (1, 1 << 20), 1),
                                                 (True, None, 0)])
def test_longest_first_order_is_sorted_once_per_step(monkeypatch, unroll, window, sorts):
    """The model's decode step with every grid longest first: the rows' argsort is the same
    computation in every layer, so the compiled step holds one sort (XLA's CSE unrolled, its
    loop-invariant hoisting under the scan), not one per layer. With the default window the
    tiny model's small grids (8 rows x its kv heads) keep the grid order: no sort at all."""
    from dense_reference import random_flat
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine
    from checkpoints.model_state import build_model
    from jaxinfer.step_input import dummy_input
    from engine_util import TINY
    from pallas_kernels import tuning
    assert TINY.num_layers > 1
    if window is not None:
        monkeypatch.setattr(tuning, "LONGEST_FIRST_PROGRAMS", window)
    jax.clear_caches()      # the decoder layer's trace from another window
    cfg = EngineConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                       page_size=4, attention_impl="pallas")
    engine = Engine(TINY, cfg, *build_model(TINY, random_flat(TINY, seed=1), jnp.float32,
                                             unroll_layers=unroll))
    bucket = next(b for b in engine.buckets.all_buckets() if b.decode_only and b.num_seqs == 8)
    inp = engine.runner.prepare(dummy_input(bucket, max_num_seqs=8))
    text = engine.runner.lower(inp).compile().as_text()
    assert len(re.findall(r"^\s*(?:ROOT )?%\S+ = .* sort\(", text, re.M)) == sorts
