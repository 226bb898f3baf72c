"""The PDL weight-prefetch GEMV probe (bench/probes/pdl_gemv.py) in Mosaic GPU's interpret
mode: its partial products sum to W . x^T, persistent programs and splits included, and its
chain of layers agrees with the XLA route's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.probes import pdl_gemv as pg


@pytest.mark.parametrize("cfg", [pg.Config(64, 64, 2, 2, 1), pg.Config(64, 64, 3, 1, 1),
                                 pg.Config(64, 128, 2, 2, 4)])
def test_gemv_matches_reference(cfg):
    n, k = 256, 512
    kw, kx = jax.random.split(jax.random.PRNGKey(3))
    w = jax.random.normal(kw, (n, k), jnp.float32).astype(jnp.float8_e4m3fn)
    x = jax.random.normal(kx, (pg.T, k), jnp.float32).astype(jnp.float16)
    parts = np.asarray(pg.gemv(w, x, cfg=cfg, interpret=True))
    assert parts.shape == (cfg.splits, n, pg.T)
    ref = np.asarray(w, np.float32) @ np.asarray(x, np.float32).T
    np.testing.assert_allclose(parts.sum(0), ref, rtol=1e-5, atol=1e-3)
    if cfg.splits > 1:      # each split holds its own K range, not the whole product
        assert not np.allclose(parts[0], ref, atol=1e-2)


def test_gemv_rejects_bad_input():
    w = jnp.zeros((256, 512), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="float16"):
        pg.gemv(w, jnp.zeros((pg.T, 512), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="does not tile"):
        pg.gemv(w, jnp.zeros((pg.T, 512), jnp.float16), cfg=pg.Config(64, 256, 2, 4, 1),
                interpret=True)
    with pytest.raises(ValueError, match="pdl must be"):
        pg.gemv(w, jnp.zeros((pg.T, 512), jnp.float16), pdl="early", interpret=True)


def test_chain_matches_xla_route():
    layers = pg.make_layers(2, 256, 512, 384, jax.random.PRNGKey(0))
    x0 = jax.random.normal(jax.random.PRNGKey(1), (1, 256), jnp.float32).astype(jnp.bfloat16)
    xla = np.asarray(pg.chain("xla", x0, layers), np.float32)
    for impl in ("mgpu", "pdl"):
        got = np.asarray(pg.chain(impl, x0, layers, interpret=True), np.float32)
        assert np.abs(got - xla).max() / np.abs(xla).max() < 2e-2, impl


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["", "prefetch", "top"])
def test_gemv_on_gpu_at_8b_shapes(pdl):
    """The wgmma form the H200 times (interpret mode runs a plain dot instead)."""
    for (k, n), cfg in pg.CONFIGS.items():
        kw, kx = jax.random.split(jax.random.PRNGKey(k + n))
        w = jax.random.normal(kw, (n, k), jnp.float32).astype(jnp.float8_e4m3fn)
        x = jax.random.normal(kx, (pg.T, k), jnp.float32).astype(jnp.float16)
        got = np.asarray(pg.gemv(w, x, cfg=cfg, pdl=pdl)).sum(0)
        ref = np.asarray(w, np.float32) @ np.asarray(x, np.float32).T
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 1e-4, (k, n, err)
