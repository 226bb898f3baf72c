"""FP8 linear: quantization error bounds, kernel vs reference, dispatch, orbax round trip.

Error bounds used below (why the tolerances are what they are):
- e4m3 has 3 mantissa bits, so rounding a normal value costs at most half an ulp, 2^-4 of it;
  below 2^-6 (subnormals, after dividing by the channel scale) the step is 2^-9, so at most
  2^-10 * scale absolute. quantize_linear must stay inside max of the two, per weight.
- The decode kernel multiplies the exact dequantized weights (fp8 -> bf16/f32 is exact) with
  x in f32 accumulation, like the reference; the only extra error is the bf16 output rounding
  (2^-9 relative per element), so ||y - ref|| / ||ref|| <= 5e-3 for bf16 x.
- The prefill route also rounds x to e4m3 per token (<= 2^-4 per element, ~2-3% in norm on
  random data): 5e-2 against the reference; against the reference fed the same rounded x it
  is again only output rounding (5e-3).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import fp8 as ckpt_fp8
from pallas_kernels import fp8_matmul as fm

# (K, N) projection shapes, scaled down for the CPU: Llama-3-8B by 16 (qkv 4096x6144,
# wo 4096x4096, gate+up 4096x28672, down 14336x4096) and Qwen2.5-32B by 16 (qkv 5120x7168,
# gate+up 5120x55296 -> one half, down 27648x5120): the odd factors (7, 3, 27, 5) stay.
CPU_SHAPES = [(256, 384), (256, 256), (256, 1792), (896, 256), (320, 448), (320, 1728),
              (1728, 320)]
# On the GPU: one qkv-like, one down-like shape per model (bench/fp8_matmul.py checks the rest).
GPU_SHAPES = [(4096, 6144), (27648, 5120)]
M_VALUES = [1, 3, 16, 64, 128]


def _rel(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(y)), "non-finite output"
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


def _weights(rng, k, n, layers=None):
    """Random weights whose channel magnitudes differ by ~100x, like real projections."""
    shape = (k, n) if layers is None else (layers, k, n)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    return w * np.exp(rng.uniform(-2.3, 2.3, size=shape[:-2] + (1, n))).astype(np.float32)


def test_quantize_linear_error_bound_and_layout():
    rng = np.random.default_rng(0)
    w = _weights(rng, 64, 48, layers=2)
    w[1, :, 5] = 0.0                                  # a dead channel must not produce NaN
    w[0, 3, 7] = 1e-9                                 # deep in the subnormal range
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(w))
    assert w_q.dtype == jnp.float8_e4m3fn and w_q.shape == (2, 48, 64)
    assert scale.dtype == jnp.float32 and scale.shape == (2, 48)
    dq = np.asarray(ckpt_fp8.dequantize_linear(w_q, scale))
    assert dq.shape == w.shape and np.all(np.isfinite(dq))
    bound = np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * np.asarray(scale)[:, None, :])
    assert np.all(np.abs(dq - w) <= bound * (1 + 1e-6) + 1e-30)
    # each channel's largest weight lands on e4m3's largest finite value, exactly
    assert np.allclose(np.max(np.abs(np.asarray(w_q, np.float32)), axis=-1)[0], 448.0)


def test_quantize_linear_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[\.\.\., in, out\]"):
        ckpt_fp8.quantize_linear(jnp.ones((8,)))
    with pytest.raises(TypeError, match="float"):
        ckpt_fp8.quantize_linear(jnp.ones((8, 8), jnp.int32))


@pytest.mark.parametrize("k,n", CPU_SHAPES)
def test_skinny_kernel_matches_reference(k, n):
    """The Pallas decode kernel itself (interpret mode) at every M, including past the
    dispatch threshold, and with K split (splits > 1) on the shapes whose N is small."""
    rng = np.random.default_rng(k * 7 + n)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, k, n)))
    for m in M_VALUES:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        t = fm.skinny_tiles(m, k, n)
        assert t is not None
        y = fm.skinny_fp8_matmul(x, w_q[None], scale[None], jnp.zeros((1,), jnp.int32), t,
                                 interpret=True)
        assert y.shape == (m, n) and y.dtype == jnp.bfloat16
        assert _rel(y, fm.fp8_linear_reference(x, w_q, scale)) < 5e-3, (m, t)


@pytest.mark.parametrize("reduce_each_step,prefetch,bn,bk", [
    (True, 1, 16, 128), (False, 2, 8, 64), (True, 3, 4, 256), (True, 2, 32, 64)])
def test_gemv_variants_match_reference(reduce_each_step, prefetch, bn, bk):
    """The GEMV's tuning variants (per-step reduction, deeper load prefetch, other tiles)
    compute the same product, splits included."""
    k, n = 1024, 96
    rng = np.random.default_rng(bn * bk + prefetch)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, k, n)))
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    t = fm.skinny_tiles(1, k, n, bn_cap=bn, bk_cap=bk, reduce_each_step=reduce_each_step,
                        prefetch=prefetch)
    assert (t.bn, t.bk, t.prefetch, t.reduce_each_step) == (min(bn, 32), bk, prefetch,
                                                            reduce_each_step)
    y = fm.skinny_fp8_matmul(x, w_q[None], scale[None], jnp.zeros((1,), jnp.int32), t,
                             interpret=True)
    assert _rel(y, fm.fp8_linear_reference(x, w_q, scale)) < 5e-3, t


def test_gemv_on_tensor_cores_matches_reference():
    """M = 1 through the dot path (x padded to 16 rows)."""
    k, n = 512, 128
    rng = np.random.default_rng(5)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, k, n)))
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    t = fm.skinny_tiles(1, k, n, tensor_cores=True, bn_cap=32, bk_cap=128)
    assert (t.mp, t.bn, t.bk) == (16, 32, 128)
    y = fm.skinny_fp8_matmul(x, w_q[None], scale[None], jnp.zeros((1,), jnp.int32), t,
                             interpret=True)
    assert y.shape == (1, n) and _rel(y, fm.fp8_linear_reference(x, w_q, scale)) < 5e-3


def test_default_gemv_tiles_are_the_tuned_ones():
    """On Llama-3-8B's projection shapes the default M = 1 tiling is a valid one and is
    tuning.FP8_GEMV."""
    from pallas_kernels.tuning import FP8_GEMV

    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        t = fm.skinny_tiles(1, k, n)
        assert t is not None and (k // t.splits) % t.bk == 0, (k, n)
        assert (t.bn, t.bk, t.reduce_each_step) == (FP8_GEMV.bn, FP8_GEMV.bk,
                                                    FP8_GEMV.reduce_each_step)


def test_gemv_f32_is_exact_to_f32_rounding():
    rng = np.random.default_rng(1)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, 512, 256)))
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.float32)
    y = fm.skinny_fp8_matmul(x, w_q[None], scale[None], jnp.zeros((1,), jnp.int32),
                             fm.skinny_tiles(1, 512, 256), interpret=True)
    assert y.dtype == jnp.float32
    assert _rel(y, fm.fp8_linear_reference(x, w_q, scale)) < 1e-5


def test_split_k_is_used_and_correct():
    """N too small to fill the GPU: K must be split, and the partial sums added right."""
    k, n = 2048, 64
    t = fm.skinny_tiles(1, k, n)
    assert t.splits > 1
    rng = np.random.default_rng(2)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, k, n)))
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    y = fm.skinny_fp8_matmul(x, w_q[None], scale[None], jnp.zeros((1,), jnp.int32), t,
                             interpret=True)
    assert _rel(y, fm.fp8_linear_reference(x, w_q, scale)) < 5e-3


@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_fp8_linear_routes_by_m(m):
    """M <= 64 unstacked goes to XLA's fused-dequant GEMM (M < 8 padded to 8 rows and cut
    back), never the Pallas kernel; stacked weights at M == 1 go to the Pallas kernel."""
    rng = np.random.default_rng(10 + m)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, 256, 128, layers=2)))
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)

    def uses_pallas(**kw):
        return "pallas_call" in str(jax.make_jaxpr(
            lambda x: fm.fp8_linear(x, *kw.pop("w"), interpret=True, **kw))(x))

    assert not uses_pallas(w=(w_q[0], scale[0]))
    assert uses_pallas(w=(w_q, scale), layer=jnp.int32(1)) == (m == 1)
    y = fm.fp8_linear(x, w_q[0], scale[0], interpret=True)
    assert y.shape == (m, 128) and _rel(y, fm.fp8_linear_reference(x, w_q[0], scale[0])) < 5e-3


@pytest.mark.parametrize("m", [1, 3, 128])
def test_fp8_linear_stacked_layer_index(m):
    """layer= indexes a stacked [L, N, K] weight, on each route: m=1 the Pallas kernel
    (which indexes the layer itself), m=3 the XLA dequant GEMM, m=128 the FP8 GEMM."""
    rng = np.random.default_rng(3 + m)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, 256, 384, layers=3)))
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    tol = 5e-3 if m <= fm.DEQUANT_MAX_M else 5e-2
    for layer in range(3):
        y = fm.fp8_linear(x, w_q, scale, layer=jnp.int32(layer), interpret=True)
        assert _rel(y, fm.fp8_linear_reference(x, w_q[layer], scale[layer])) < tol


def test_tensor_core_route_error_is_the_activation_rounding():
    rng = np.random.default_rng(4)
    w_q, scale = ckpt_fp8.quantize_linear(jnp.asarray(_weights(rng, 256, 256)))
    x = jnp.asarray(rng.standard_normal((256, 256)) * rng.uniform(0.1, 10, (256, 1)),
                    jnp.bfloat16)
    y = fm.fp8_linear(x, w_q, scale, interpret=True)
    assert _rel(y, fm.fp8_linear_reference(x, w_q, scale)) < 5e-2
    # the same per-token e4m3 rounding of x, done by hand, leaves only output rounding
    x_q, x_scale = ckpt_fp8.quantize_linear(x.astype(jnp.float32).T)
    x_rounded = ckpt_fp8.dequantize_linear(x_q, x_scale).T
    ref = fm.fp8_linear_reference(x_rounded.astype(jnp.float32), w_q, scale)
    assert _rel(y, ref) < 5e-3


def test_fp8_linear_rejects_bad_input():
    w_q, scale = ckpt_fp8.quantize_linear(jnp.ones((32, 16)))
    with pytest.raises(ValueError, match="K=8"):
        fm.fp8_linear(jnp.ones((1, 8)), w_q, scale)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fm.fp8_linear(jnp.ones((1, 32)), w_q.astype(jnp.bfloat16), scale)
    with pytest.raises(ValueError, match=r"\[L, N, K\]"):
        fm.fp8_linear(jnp.ones((1, 32)), w_q, scale, layer=0)


def test_quantize_params_and_orbax_round_trip(tmp_path):
    rng = np.random.default_rng(5)
    flat = {name: _weights(rng, 32, 48, layers=2) for name in ckpt_fp8.LINEAR_NAMES}
    flat["embed"] = rng.standard_normal((100, 32)).astype(np.float32)
    flat["lm_head"] = _weights(rng, 32, 100)
    q = ckpt_fp8.quantize_params(flat, lm_head=True)
    assert q["embed"] is flat["embed"]
    assert q["wq"].dtype == jnp.float8_e4m3fn and q["wq"].shape == (2, 48, 32)
    assert q["wq_scale"].shape == (2, 48) and q["lm_head"].shape == (100, 32)
    assert np.allclose(np.asarray(ckpt_fp8.dequantize_linear(q["w_up"], q["w_up_scale"])),
                       flat["w_up"], rtol=2.0**-4, atol=1e-3)
    ckpt_fp8.save_params(tmp_path / "fp8", q)
    back = ckpt_fp8.restore_params(tmp_path / "fp8")
    assert sorted(back) == sorted(q)
    for key, value in q.items():
        assert back[key].dtype == value.dtype, key
        assert np.array_equal(np.asarray(back[key]).view(np.uint8),
                              np.asarray(value).view(np.uint8)), key
    with pytest.raises(KeyError, match="wq"):
        ckpt_fp8.quantize_params({"embed": flat["embed"]})
    with pytest.raises(ValueError, match="quantized already"):
        ckpt_fp8.quantize_params(q)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", GPU_SHAPES)
def test_fp8_linear_gpu_real_shapes(k, n):
    assert jax.default_backend() == "gpu"
    key = jax.random.PRNGKey(k + n)
    w = jax.random.normal(key, (k, n), jnp.float32) * 0.02
    w_q, scale = ckpt_fp8.quantize_linear(w)
    for m in [1, 3, 16, 128, 2048]:
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
        y = fm.fp8_linear(x, w_q, scale)
        tol = 5e-3 if m <= fm.DEQUANT_MAX_M else 5e-2
        assert y.shape == (m, n) and _rel(y, fm.fp8_linear_reference(x, w_q, scale)) < tol, m


@pytest.mark.gpu
def test_prefill_route_uses_cublaslt_fp8():
    key = jax.random.PRNGKey(6)
    w_q, scale = ckpt_fp8.quantize_linear(jax.random.normal(key, (4096, 4096)))
    x = jax.random.normal(key, (2048, 4096), jnp.bfloat16)
    hlo = fm.fp8_linear.lower(x, w_q, scale).compile().as_text()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]*)"', hlo)))
    fp8_fusions = [ln.strip()[:300] for ln in hlo.splitlines()
                   if "fusion(" in ln and "f8e4m3fn" in ln]
    assert "__cublas$lt$matmul$f8" in targets, (targets, fp8_fusions)
