"""The batch-1 GEMV with fused neighbours (pallas_kernels/gemv.py) against the model's own ops
(gemv_reference): interpret mode on the CPU over prologues, residual, K splits and both
accumulators; the gpu-marked case at Llama-3-8B's projection shapes on the H200."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gemv as gv

ON_GPU = jax.default_backend() == "gpu"


def _inputs(seed, k, n, prologue, residual):
    rng = np.random.default_rng(seed)
    width = 2 * k if prologue == "swiglu" else k
    x = jnp.asarray(rng.standard_normal((1, width)) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    nw = (jnp.asarray(rng.uniform(0.5, 1.5, k), jnp.bfloat16) if prologue == "rmsnorm"
          else None)
    r = jnp.asarray(rng.standard_normal((1, n)) * 4, jnp.bfloat16) if residual else None
    return x, w, dict(prologue=prologue, norm_weight=nw, residual=r)


def _magnitude(x, w, prologue):
    """sum_k |p(x)_k w_kn| in f32: the scale of what bf16 rounding of p(x) can move."""
    xf, wf = np.asarray(x, np.float32), np.abs(np.asarray(w, np.float32))
    if prologue == "rmsnorm":
        xf = xf / np.sqrt(np.mean(xf * xf) + 1e-6) * 1.5
    elif prologue == "swiglu":
        gate, up = np.split(xf, 2, axis=-1)
        xf = gate / (1 + np.exp(-gate)) * up
    return np.abs(xf) @ wf


def _check(got, want, x, w, prologue):
    assert got.shape == want.shape and got.dtype == want.dtype
    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # Both round p(x) to bf16 (XLA may round SiLU's inner steps elsewhere: up to ~2^-8 of
    # each term), sum in f32 in another order, and round the result (and with a residual the
    # product before the add) to bf16: a step of 2^-8 relative each.
    bound = 2.0 ** -7 * (np.abs(r) + _magnitude(x, w, prologue)) + 1e-3
    assert (np.abs(g - r) <= bound).all(), np.max(np.abs(g - r) - bound)
    # those roundings are unbiased: on average well under a bf16 step (a 2% error in the
    # SiLU or the norm weight fails here, not above)
    assert np.mean(np.abs(g - r)) <= 2.0 ** -7 * np.mean(np.abs(r))


@pytest.mark.parametrize("prologue", gv.PROLOGUES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("tiles", [gv.Tiles(bn=32, bk=64), gv.Tiles(bn=16, bk=32, splits=2),
                                   gv.Tiles(bn=32, bk=32, reduce_each_step=False)])
def test_gemv_matches_model_ops(prologue, residual, tiles):
    x, w, kw = _inputs(3, 128, 64, prologue, residual)
    _check(gv.gemv(x, w, tiles=tiles, interpret=True, **kw), gv.gemv_reference(x, w, **kw),
           x, w, prologue)


def test_tiles_for_splits_small_grids():
    assert gv.tiles_for(4096, 28672) == gv.Tiles(bn=64, bk=256, splits=1)   # 448 programs
    assert gv.tiles_for(4096, 4096).splits == 4                            # 64 -> 256
    assert gv.tiles_for(14336, 4096, bk=512).splits == 4                   # 28 steps: 7 each
    assert gv.tiles_for(96, 48).bn == 16 and gv.tiles_for(96, 48).bk == 32


def test_gemv_rejects_bad_input():
    x, w, kw = _inputs(0, 64, 32, "rmsnorm", False)
    with pytest.raises(ValueError, match="prologue must be"):
        gv.gemv(x, w, prologue="gelu", interpret=True)
    with pytest.raises(ValueError, match="norm_weight is required"):
        gv.gemv(x, w, prologue="rmsnorm", interpret=True)
    with pytest.raises(ValueError, match="swiglu takes"):
        gv.gemv(x, w, prologue="swiglu", interpret=True)
    with pytest.raises(ValueError, match="residual must be"):
        gv.gemv(x, w, residual=jnp.zeros((1, 31), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="do not divide"):
        gv.gemv(x, w, tiles=gv.Tiles(bn=64, bk=32), interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs the GPU")
@pytest.mark.parametrize("k,n,prologue,residual", [(4096, 6144, "rmsnorm", False),
                                                   (4096, 4096, "none", True),
                                                   (4096, 28672, "rmsnorm", False),
                                                   (14336, 4096, "swiglu", True)])
def test_gemv_gpu_llama3_8b_shapes(k, n, prologue, residual):
    x, w, kw = _inputs(k + n, k, n, prologue, residual)
    _check(gv.gemv(x, w, **kw), gv.gemv_reference(x, w, **kw), x, w, prologue)


def test_gemv_bench_rows_on_cpu(tmp_path, monkeypatch):
    """bench/gemv.py end to end on small shapes (interpret mode): every row timed, its error
    against the model's ops small, its compiled kernels recorded."""
    from bench import gemv as bench_gemv
    monkeypatch.setattr(bench_gemv, "GEMV_FUSION", {(128, 64): ("rmsnorm", False),
                                                    (64, 32): ("swiglu", True)})
    monkeypatch.setattr(bench_gemv, "GEMV_TILES", [dict(bn=32, bk=32), dict(bk=32, splits=2)])
    out = tmp_path / "gemv.json"
    result = bench_gemv.main(["--shapes", "128x64,64x32", "--samples", "1", "--rotate-mb",
                              "0.01", "--max-rotate", "2", "--git", "abc", "--out", str(out)])
    rows = result["rows"]
    assert [r["impl"].split("_")[0] for r in rows] == ["xla", "gemv", "gemv"] * 2
    assert all("us" in r and r["max_abs_err"] < 0.1 and "by_kind" in r["hlo"] for r in rows)
    assert out.exists() and result["git"] == "abc"


@pytest.mark.parametrize("m", [1, 96])
def test_fp8_matmul_bench_ksplit_variants_compute_the_product(m):
    """bench/fp8_matmul.py --ksplit's variants (K slices as a batch axis, partials summed;
    the transposed tensor-core product) give their unsplit route's result."""
    from bench import fp8_matmul as bf
    from checkpoints.fp8 import quantize_linear
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 64)) * 0.05, jnp.float32)
    w_q, scale = quantize_linear(w)
    wb = w.astype(jnp.bfloat16)
    variants = bf.ksplit_variants(m, [2, 4])
    assert set(variants) == {"xla_bf16_k2", "xla_bf16_k4"} | (
        {"dequant_k2", "dequant_k4"} if m == 1 else {"tc_k2", "tc_k4", "tc_transposed"})
    for name, fn in variants.items():
        got = np.asarray(fn(x, wb, w_q, scale), np.float32)
        if name.startswith("xla_bf16"):
            want = np.asarray(bf.xla_bf16(x, wb, w_q, scale), np.float32)
        elif name.startswith("dequant"):
            want = np.asarray(bf.xla_fp8_dequant(x, wb, w_q, scale), np.float32)
        else:
            want = np.asarray(bf.tensor_core_route(x, wb, w_q, scale), np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=name)
