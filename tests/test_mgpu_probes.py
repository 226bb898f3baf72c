"""The Mosaic GPU probes (bench/probes/mgpu_*.py) in Mosaic GPU's interpret
mode on the CPU: their work-item indexing and pipelines against plain-jnp references on fresh
random e4m3 weights. The wgmma register operand, transposed operands and the TMA reduction
are replaced there (the modules say how); the H200 runs check those forms (rel_err in their
result files)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.fp8 import quantize_linear

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu",
                                reason="interpret mode; the GPU forms run in the H200 probes")


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("tokens, cfg", [
    (16, (64, 64, 2, 2, 0, 0, 0)),    # a grid of (N / 64) x 2 programs, x^T tiles N-major
    (16, (64, 32, 3, 2, 1, 0, 0)),    # persistent: 2 programs stride over 8 work items
    (8, (128, 64, 2, 1, 1, 0, 1)),    # 8 token columns, x tiles K-major, 128-row items
])
def test_gemv_matches_the_reference(tokens, cfg):
    from bench.probes import mgpu_gemv as mg
    k, n = 128, 256
    key = jax.random.PRNGKey(sum(cfg) + tokens)
    w_q, _ = quantize_linear(jax.random.normal(key, (k, n)) * 0.02)
    x = jax.random.normal(jax.random.fold_in(key, 1), (tokens, k)).astype(jnp.float16)
    c = mg.Config(*cfg)
    out = mg.gemv_t(w_q, x, cfg=c, interpret=True)
    assert out.shape == (c.splits, n, tokens)
    assert _rel(out.sum(0), mg.reference(w_q, x)) < 1e-5


def test_gemv_refuses_tiles_that_do_not_divide():
    from bench.probes import mgpu_gemv as mg
    w = jnp.zeros((192, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not tile"):
        mg.gemv_t(w, jnp.zeros((8, 256), jnp.float16), cfg=mg.Config(128, 64), interpret=True)


def _mlp_case(e=256, f=128):
    from bench.probes import mgpu_mlp as mm
    from bench.probes.mgpu_mlp_w8a8 import R
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(7), 4)
    w_gu, s_gu = quantize_linear(jax.random.normal(k1, (e, 2 * f)) * 0.05)
    w_d, s_d = quantize_linear(jax.random.normal(k2, (f, e)) * 0.05)
    x = jax.random.normal(k3, (R, e))
    resid = jax.random.normal(k4, (R, e), jnp.float32)
    mlp = mm.reference(x, w_gu, s_gu, w_d, s_d, resid) - resid
    return (w_gu, s_gu, w_d, s_d), x, resid, mlp


def test_fused_mlp_matches_the_reference():
    """Two programs (F-slices of 64): y = residual + down(SiLU(gate) * up), channel scales
    applied, each program's down partial added into y."""
    from bench.probes import mgpu_mlp as mm
    w, x, resid, mlp = _mlp_case()
    xt, y0 = mm.pad_t(x, resid)
    out = mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(64, 64, 128, 2), interpret=True)
    assert _rel(out.T[:len(x)] - resid, mlp) < 5e-3    # x and h rounded to f16
    with pytest.raises(ValueError, match="does not tile"):
        mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(96, 64, 128, 2), interpret=True)
    # two output slots in flight (64-row down tiles: 4 steps, both slots reused)
    out = mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(64, 64, 64, 2, obufs=2), interpret=True)
    assert _rel(out.T[:len(x)] - resid, mlp) < 5e-3


def test_fused_mlp_down_only_and_staggered_down_tiles():
    """down_only: the down phase alone over h = 0, y stays the residual. stagger: each
    program walks its down tiles from its own start (a permutation of the same work), in
    the f16 and warp-specialized forms."""
    from bench.probes import mgpu_mlp as mm
    from bench.probes.mgpu_mlp_ws import fused_mlp_ws
    w, x, resid, mlp = _mlp_case()
    xt, y0 = mm.pad_t(x, resid)
    out = mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(64, 64, 128, 2, down_only=1),
                         interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(y0), rtol=0, atol=1e-6)
    out = mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(64, 64, 64, 2, stagger=1), interpret=True)
    assert _rel(out.T[:len(x)] - resid, mlp) < 5e-3
    # only the first 4 token columns reduce-added: those rows right, the others unchanged
    out = mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(64, 64, 64, 2, out_cols=4), interpret=True)
    assert _rel(out.T[:4] - resid[:4], mlp[:4]) < 5e-3
    np.testing.assert_allclose(np.asarray(out[:, 4:]), np.asarray(y0[:, 4:]), rtol=0, atol=0)
    order = mm.down_order(mm.Config(64, 64, 64, stagger=1), 3, 256)
    assert [int(order(j)) for j in range(4)] == [3, 0, 1, 2]
    order = mm.down_order(mm.Config(64, 64, 64, stagger=1, group=2), 1, 256)
    assert [int(order(j)) for j in range(4)] == [2, 3, 0, 1]
    # tiles stored two at a time, staggered by groups, with and without the column repack
    for cols in (0, 4):
        out = mm.fused_mlp_t(xt, *w, y0, interpret=True,
                             cfg=mm.Config(64, 64, 64, 2, stagger=1, out_cols=cols, group=2))
        assert _rel(out.T[:len(x)][:cols or 8] - resid[:cols or 8], mlp[:cols or 8]) < 5e-3
    with pytest.raises(ValueError, match="does not tile"):
        mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(64, 64, 128, 2, group=4), interpret=True)
    with pytest.raises(ValueError, match="GPU timing split"):
        mm.fused_mlp_t(xt, *w, y0, cfg=mm.Config(64, 64, 64, 2, no_epi=1), interpret=True)
    (w_gu, s_gu, w_d, s_d), x, resid, mlp = _mlp_case(e=256, f=256)
    xt, y0 = mm.pad_t(x, resid)
    out = fused_mlp_ws(xt, w_gu, s_gu, w_d, s_d, y0, cfg=mm.Config(128, 64, 128, 2, stagger=1),
                       interpret=True)
    assert _rel(out.T[:len(x)] - resid, mlp) < 5e-3


def test_fused_mlp_w8a8_matches_the_reference():
    """The FP8-activation form, two programs: x quantized per token, h per token and F-slice,
    both to e4m3 (3 mantissa bits, ~3.6% rms each); an indexing error would be ~100%."""
    from bench.probes import mgpu_mlp as mm
    from bench.probes.mgpu_mlp_w8a8 import fused_mlp_q, quantize_tokens
    w, x, resid, mlp = _mlp_case()
    out = fused_mlp_q(*quantize_tokens(x), *w, resid, cfg=mm.Config(64, 64, 128, 2),
                      interpret=True)
    assert _rel(out - resid, mlp) < 0.08


def test_fused_mlp_blocked_down_weights():
    """w_d blocked per F-slice ([F / FS, E, FS], mgpu_mlp.block_down): the same result as
    the [E, F] layout, in both forms; a blocked w_d of the wrong slice width is refused."""
    from bench.probes import mgpu_mlp as mm
    (w_gu, s_gu, w_d, s_d), x, resid, mlp = _mlp_case()
    xt, y0 = mm.pad_t(x, resid)
    cfg = mm.Config(64, 64, 128, 2, blocked=1)
    wb = mm.block_down(w_d, 64)
    assert wb.shape == (2, 256, 64) and bool(jnp.all(wb[1, :, 3] == w_d[:, 67]))
    out = mm.fused_mlp_t(xt, w_gu, s_gu, wb, s_d, y0, cfg=cfg, interpret=True)
    assert _rel(out.T[:len(x)] - resid, mlp) < 5e-3
    with pytest.raises(ValueError, match="blocked w_d"):
        mm.fused_mlp_t(xt, w_gu, s_gu, mm.block_down(w_d, 128), s_d, y0, cfg=cfg,
                       interpret=True)


def test_fused_mlp_warp_specialized_matches_the_reference():
    """fused_mlp_ws: two programs of three warpgroups (two computing half of each F-slice's
    rows, one issuing the copies), the halves of h joined at a barrier."""
    from bench.probes import mgpu_mlp as mm
    from bench.probes.mgpu_mlp_ws import fused_mlp_ws
    (w_gu, s_gu, w_d, s_d), x, resid, mlp = _mlp_case(e=128, f=256)
    xt, y0 = mm.pad_t(x, resid)
    out = fused_mlp_ws(xt, w_gu, s_gu, w_d, s_d, y0, cfg=mm.Config(128, 64, 128, 2),
                          interpret=True)
    assert _rel(out.T[:len(x)] - resid, mlp) < 5e-3
    with pytest.raises(ValueError, match="compute warpgroups"):
        fused_mlp_ws(xt, w_gu, s_gu, w_d, s_d, y0, cfg=mm.Config(64, 64, 128, 2),
                        interpret=True)


def test_probe_mains_write_their_rows(tmp_path):
    """The probes' command lines end to end on the CPU (host clock only): every row correct
    and no config refused at the small shapes."""
    import json

    from bench.probes import mgpu_gemv as mg
    from bench.probes import mgpu_mlp as mm
    mg.main(["--shapes", "128x128", "--tokens", "8", "--configs", "64,64,2,1,1,0,1",
             "--out", str(tmp_path / "g.json")])
    mm.main(["--shape", "128x128", "--forms", "w8a16,w8a8r1", "--configs", "128,64,128,2",
             "--out", str(tmp_path / "m.json")])
    g = json.loads((tmp_path / "g.json").read_text())["rows"]
    m = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert [r["impl"] for r in g] == ["xla_dequant", "mgpu"]
    assert [r["impl"] for r in m] == ["xla_route", "mgpu_mlp", "mgpu_mlp_w8a8_r1"]
    for r in g + m:        # (the GEMV probe times its own kernel on the GPU only)
        assert "error" not in r and (r["impl"] == "mgpu" or r["us"] > 0), r
    assert g[1]["rel_err"] < 1e-5 and m[1]["rel_err"] < 5e-3
    assert all(r["rel_err"] < 0.01 for r in m[2:])   # relative to y, residual included
