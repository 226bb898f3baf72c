"""The fused SiLU * up + per-token e4m3 kernel (pallas_kernels/swiglu_quant.py) against its
jnp reference, in interpret mode on the CPU (the same cases marked gpu run the real kernel),
and the fused FP8 MLP against the unfused tensor-core route."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import fp8 as ckpt_fp8
from pallas_kernels import swiglu_quant as sq

ON_GPU = jax.default_backend() == "gpu"


def _inputs(rng, m, f, zero_row=None):
    y = rng.standard_normal((m, 2 * f)) * rng.uniform(0.1, 8, (m, 1))
    if zero_row is not None:
        y[zero_row] = 0.0
    return (jnp.asarray(y, jnp.bfloat16),
            jnp.asarray(rng.uniform(0.01, 1, (m, 1)), jnp.float32),
            jnp.asarray(rng.uniform(0.5, 2, (2 * f,)), jnp.float32))


def _check(q, s, qr, sr):
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    assert q.shape == qr.shape and s.shape == sr.shape
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-5)
    a, b = (np.asarray(v.astype(jnp.float32)) * np.asarray(w) for v, w in ((q, s), (qr, sr)))
    # the same rounding up to exp/division's last bits: codes differ by one e4m3 step at most,
    # and only where h sat on a rounding boundary
    step = np.abs(b) * 2.0 ** -3 + np.asarray(sr) * 2.0 ** -9
    assert (np.abs(a - b) <= step * 1.01).all()
    assert np.mean(np.asarray(q.astype(jnp.float32)) != np.asarray(qr.astype(jnp.float32))) < 0.01


@pytest.mark.parametrize("m,f,zero_row", [(1, 64, None), (3, 192, 1), (16, 1536, None),
                                          (5, 48, 4)])
def test_kernel_matches_reference(m, f, zero_row):
    y, xs, ws = _inputs(np.random.default_rng(m * 100 + f), m, f, zero_row)
    q, s = sq.swiglu_quant(y, xs, ws, interpret=not ON_GPU)
    qr, sr = sq.swiglu_quant_reference(y, xs, ws)
    _check(q, s, qr, sr)
    if zero_row is not None:   # an all-zero row: scale 1, codes 0
        assert float(s[zero_row, 0]) == 1.0 and not np.asarray(q[zero_row].astype(jnp.float32)).any()


@pytest.mark.parametrize("m,f,tiles", [
    (8, 192, sq.Tiles(rows=4, chunk=64, two_pass=True, num_warps=4)),   # 2F/BF loop steps
    (6, 96, sq.Tiles(rows=4, two_pass=True)),                          # BM 2 divides M = 6
    (4, 64, sq.Tiles(rows=2, chunk=16, num_warps=1)),                  # one pass, 2 rows
    (4, 64, sq.Tiles(chunk=16, fast_math=True)),                       # exp2, 1 / scale
    (8, 96, sq.Tiles(rows=2, chunk=32, fast_math=True, two_pass=True, num_warps=4)),
    # TILES_LARGE's form: 1-D rows, one amax reduction, x_scale folded out, 4 rows in a loop
    # (the PTX sigmoid runs on the GPU; interpret mode takes fast_math's jnp form)
    (8, 64, sq.Tiles(chunk=16, asm=True, clip=False, flat=True, vec_amax=True, row_loop=4,
                     fold_xs=True)),
    (6, 96, sq.Tiles(chunk=32, flat=True, row_loop=2, evict_first=True)),   # exact math
    (4, 64, sq.Tiles(rows=2, chunk=16, fast_math=True, vec_amax=True, fold_xs=True))])
def test_other_tiles_match_reference(m, f, tiles):
    y, xs, ws = _inputs(np.random.default_rng(m + f), m, f, zero_row=1)
    assert sq.supported(f, tiles)
    q, s = sq.swiglu_quant(y, xs, ws, interpret=not ON_GPU, tiles=tiles)
    _check(q, s, *sq.swiglu_quant_reference(y, xs, ws))


def test_tiles_and_fallback():
    assert sq.chunk(14336) == 2048 and sq.chunk(1536) == 512 and sq.chunk(48) == 16
    assert sq.chunk(8) is None and sq.chunk(40) is None and sq.chunk(14336, 1000) == 512
    assert sq.pow2_divisor(256, 4) == 4 and sq.pow2_divisor(6, 4) == 2 and sq.pow2_divisor(7, 8) == 1
    assert sq.supported(14336) and not sq.supported(40)
    assert not sq.supported(sq.max_live(sq.TILES) * 2)
    assert sq.supported(sq.max_live(sq.TILES) * 2, sq.Tiles(two_pass=True))
    # unsupported F runs the reference: same result either way
    y, xs, ws = _inputs(np.random.default_rng(0), 4, 40)
    q, s = sq.swiglu_quant(y, xs, ws, interpret=True)
    qr, sr = sq.swiglu_quant_reference(y, xs, ws)
    assert (q.astype(jnp.float32) == qr.astype(jnp.float32)).all() and (s == sr).all()


def test_row_loop_and_default_tiles():
    assert sq.loop_rows(2048, 8) == 8 and sq.loop_rows(2048, 16) == 8    # >= 132 programs
    assert sq.loop_rows(384, 8) == 2 and sq.loop_rows(488, 8) == 2 and sq.loop_rows(100, 8) == 1
    assert sq.tiles_for(sq.LARGE_M, 14336) == sq.TILES_LARGE
    assert sq.tiles_for(sq.LARGE_M - 1, 14336) == sq.TILES
    assert sq.tiles_for(sq.LARGE_M, 27648) == sq.TILES        # no room for the row loop
    assert sq.supported(14336) and sq.supported(27648)      # Llama-3-8B, Qwen2.5-32B


def test_rejects_bad_shapes():
    y, xs, ws = _inputs(np.random.default_rng(1), 4, 64)
    with pytest.raises(ValueError, match="2F"):
        sq.swiglu_quant(y, xs[:3], ws, interpret=True)
    with pytest.raises(ValueError, match="2F"):
        sq.swiglu_quant(y, xs, ws[:64], interpret=True)


def _mlp_weights(rng, e, f):
    wgu = rng.standard_normal((e, 2 * f)).astype(np.float32) * 0.05     # [in, out]
    wd = rng.standard_normal((f, e)).astype(np.float32) * 0.05
    return (*ckpt_fp8.quantize_linear(jnp.asarray(wgu)), *ckpt_fp8.quantize_linear(jnp.asarray(wd)))


@pytest.mark.parametrize("m,e,f", [(72, 64, 192), (128, 128, 256)])
def test_fused_mlp_matches_unfused_route(m, e, f):
    rng = np.random.default_rng(m + e + f)
    w = _mlp_weights(rng, e, f)
    x = jnp.asarray(rng.standard_normal((m, e)) * rng.uniform(0.1, 4, (m, 1)), jnp.bfloat16)
    got = sq.fp8_mlp(x, *w, interpret=not ON_GPU)
    want = sq.fp8_mlp_reference(x, *w)
    # exact math on the dequantized weights: both routes' error is the activations' e4m3
    wgu = ckpt_fp8.dequantize_linear(w[0], w[1])                           # [E, 2F]
    wd = ckpt_fp8.dequantize_linear(w[2], w[3])                            # [F, E]
    gu = x.astype(jnp.float32) @ wgu
    exact = (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ wd
    rel = lambda a: float(jnp.linalg.norm(a.astype(jnp.float32) - exact) / jnp.linalg.norm(exact))
    assert got.dtype == x.dtype and got.shape == (m, e)
    assert rel(got) < 0.06 and rel(want) < 0.06
    assert rel(got) < rel(want) * 1.25     # no worse than the unfused route
    assert float(jnp.linalg.norm((got - want).astype(jnp.float32))
                 / jnp.linalg.norm(want.astype(jnp.float32))) < 0.06


@pytest.mark.gpu
def test_kernel_on_gpu_at_llama_shape():
    """Llama-3-8B's MLP middle at the throughput run's decode batch (F = 14336)."""
    y, xs, ws = _inputs(np.random.default_rng(7), 256, 14336, zero_row=3)
    _check(*sq.swiglu_quant(y, xs, ws), *sq.swiglu_quant_reference(y, xs, ws))


@pytest.mark.gpu
@pytest.mark.parametrize("f,tiles", [(14336, None), (27648, None),
                                     (27648, sq.TILES_LARGE)])
def test_large_m_tiles_on_gpu(f, tiles):
    """The default tiles at a mixed step's M: TILES_LARGE (PTX sigmoid, no clip, row
    loop) for Llama-3-8B, TILES for Qwen2.5-32B's F; and TILES_LARGE forced there, past the
    row loop's register budget (one row per program)."""
    m = sq.LARGE_M
    y, xs, ws = _inputs(np.random.default_rng(f), m, f, zero_row=5)
    q, s = sq.swiglu_quant(y, xs, ws, tiles=tiles)
    _check(q, s, *sq.swiglu_quant_reference(y, xs, ws))
    assert float(s[5, 0]) == 1.0
