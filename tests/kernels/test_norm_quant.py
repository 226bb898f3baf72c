"""RMSNorm + per-token e4m3 (+ the residual add of an FP8 product) in one kernel
(pallas_kernels/norm_quant.py) against its jnp reference: interpret mode on the CPU, the
gpu-marked case on the H200 at Llama-3-8B's hidden size."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import norm_quant as nq

ON_GPU = jax.default_backend() == "gpu"


def _inputs(rng, m, e, zero_row=None):
    x = rng.standard_normal((m, e)) * rng.uniform(0.1, 20, (m, 1))
    if zero_row is not None:
        x[zero_row] = 0.0
    y = rng.standard_normal((m, e)) * 50
    return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(rng.uniform(0.5, 2, e), jnp.float32),
            (jnp.asarray(y, jnp.bfloat16), jnp.asarray(rng.uniform(1e-3, 1e-2, (m, 1)),
                                                       jnp.float32),
             jnp.asarray(rng.uniform(0.5, 2, e), jnp.float32)))


def _check(got, want, zero_row=None):
    (xg, qg, sg), (xw, qw, sw) = got, want
    if xw is None:
        assert xg is None
    else:   # the add has no reduction: the same bits
        np.testing.assert_array_equal(np.asarray(xg, np.float32), np.asarray(xw, np.float32))
    assert qg.dtype == jnp.float8_e4m3fn and sg.dtype == jnp.float32 and sg.shape == sw.shape
    np.testing.assert_allclose(np.asarray(sg), np.asarray(sw), rtol=2e-2)
    a = np.asarray(qg.astype(jnp.float32)) * np.asarray(sg)
    b = np.asarray(qw.astype(jnp.float32)) * np.asarray(sw)
    # the sum of squares is accumulated in another order: a row's normalized values may round
    # to the neighbouring bf16, then to the neighbouring e4m3 code (one step, 2^-3 relative)
    step = np.abs(b) * 2.0 ** -3 * 1.05 + np.asarray(sw) * 2.0 ** -8
    assert (np.abs(a - b) <= step).all()
    assert np.mean(np.asarray(qg.astype(jnp.float32)) != np.asarray(qw.astype(jnp.float32))) < 0.02
    if zero_row is not None:
        assert float(sg[zero_row, 0]) == 1.0


@pytest.mark.parametrize("m,e,add,zero_row", [(3, 64, True, 1), (5, 192, True, None),
                                              (4, 128, False, 2), (2, 48, False, None)])
def test_kernel_matches_reference(m, e, add, zero_row):
    x, w, delta = _inputs(np.random.default_rng(m * 1000 + e), m, e, zero_row)
    if add and zero_row is not None:   # the zero row must survive the add: no product there
        delta = (delta[0].at[zero_row].set(0), *delta[1:])
    delta = delta if add else None
    got = nq.norm_quant(x, w, delta, eps=1e-5, interpret=not ON_GPU)
    _check(got, nq.norm_quant_reference(x, w, 1e-5, delta), zero_row)


def test_unsupported_width_runs_reference_and_bad_shapes():
    x, w, delta = _inputs(np.random.default_rng(0), 2, 40)
    assert not nq.supported(40) and not nq.supported(nq.LIVE_PER_THREAD * 32 * nq.NUM_WARPS * 2)
    got = nq.norm_quant(x, w, delta, eps=1e-6, interpret=True)
    want = nq.norm_quant_reference(x, w, 1e-6, delta)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))
    with pytest.raises(ValueError, match="norm_quant"):
        nq.norm_quant(x, w[:8], eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="norm_quant"):
        nq.norm_quant(x, w, (delta[0], delta[1][:1], delta[2]), eps=1e-6, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("add", [True, False])
def test_kernel_on_gpu_at_llama_shape(add):
    x, w, delta = _inputs(np.random.default_rng(5), 256, 4096, zero_row=7)
    delta = (delta[0].at[7].set(0), *delta[1:]) if add else None
    _check(nq.norm_quant(x, w, delta, eps=1e-5),
           nq.norm_quant_reference(x, w, 1e-5, delta), zero_row=7)


def _check_quant_rows(x, zero_row):
    from pallas_kernels.fp8_matmul import quantize_rows
    q, scale = nq.quant_rows(x, interpret=not ON_GPU)
    q_ref, scale_ref = quantize_rows(x)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == scale_ref.shape == (x.shape[0], 1)
    # the same amax and codes; on the GPU the division may round its last bit differently
    np.testing.assert_allclose(np.asarray(scale), np.asarray(scale_ref), rtol=1e-6)
    a, b = (np.asarray(c.astype(jnp.float32)) for c in (q, q_ref))
    assert np.mean(a != b) < 1e-3 and (np.abs(a - b) <= np.abs(b) * 2.0 ** -3 * 1.05).all()
    assert float(scale[zero_row, 0]) == 1.0 and not a[zero_row].any()


@pytest.mark.parametrize("m,e", [(3, 64), (5, 192), (2, 40)])
def test_quant_rows_matches_quantize_rows(m, e):
    """The rows' own per-token e4m3 codes (the attention output before the O projection) in
    one kernel, against fp8_matmul.quantize_rows; a zero row gets scale 1; a width the
    kernel does not take (40) runs the reference."""
    x, _, _ = _inputs(np.random.default_rng(m + e), m, e, zero_row=1)
    _check_quant_rows(x, zero_row=1)


@pytest.mark.gpu
def test_quant_rows_on_gpu_at_llama_shape():
    x, _, _ = _inputs(np.random.default_rng(6), 384, 4096, zero_row=9)
    _check_quant_rows(x, zero_row=9)


def _fused_vs_unfused_model(monkeypatch, attention_impl="auto"):
    """The decoder's fused FP8 layer (model.DecoderLayer._fused_fp8) against the unfused
    tensor-core route on the same FP8 weights, 72 new tokens (> DEQUANT_MAX_M), and both
    against the float model. Off the GPU both routes are forced (there the FP8 linears do
    not quantize activations and the fused layer is off); attention_impl "pallas" runs the
    Pallas glue there too (interpret mode), so the fused layer's QKV scales are applied in
    the RoPE + K/V write kernel as on the GPU."""
    from dense_reference import dense_logits, random_flat
    from jaxinfer.kv_cache import single_sequence_metadata as single_sequence_md

    from jaxinfer import ops
    from jaxinfer.config import EngineConfig, standard_config
    from checkpoints.model_state import build_model
    from jaxinfer.routes import Routes
    from jaxinfer.runner import ModelRunner
    from pallas_kernels import fp8_matmul as fm

    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=11)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, 72).astype(np.int32)
    graphdef, params = build_model(cfg, flat, jnp.float32, fp8=True)
    engine = EngineConfig(page_size=4, max_model_len=80, max_num_seqs=1,   # scanned layers
                          attention_impl=attention_impl)
    md = single_sequence_md(range(72), list(range(1, 19)), 4, engine.pages_per_seq)

    def logits(routes):
        return ModelRunner(cfg, engine, graphdef, params, routes).all_logits(tokens, md)

    routes = Routes.choose(engine, jax.default_backend())
    if not ON_GPU:
        monkeypatch.setattr(ops, "_fp8_linear", lambda x, k, s, routes:
                            fm.tensor_core_fp8_matmul(x, k, s))
        routes = routes.replace(fp8_mlp=True)
    unfused = logits(routes.replace(fp8_norm_quant=False))
    decide, calls = ops.fused_fp8_layer, []

    def fused_layer(*args):
        calls.append(decide(*args))
        return calls[-1]

    monkeypatch.setattr(ops, "fused_fp8_layer", fused_layer)
    from pallas_kernels import kv_write as kw
    rope, scaled = kw.rope_write_kv, []

    def rope_spy(*args, scales=None, **kwargs):
        scaled.append(scales is not None)
        return rope(*args, scales=scales, **kwargs)

    monkeypatch.setattr(kw, "rope_write_kv", rope_spy)
    fused = logits(routes.replace(fp8_norm_quant=True))
    assert any(calls), "the fused layer was not traced"
    # with Pallas attention the QKV product's scales go to the RoPE kernel
    assert any(scaled) == (attention_impl == "pallas" or ON_GPU)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
    ref = dense_logits(cfg, flat, tokens)
    # both round activations to e4m3 per token (~2-3% per element) and weights to e4m3
    assert rel(unfused, ref) < 0.1 and rel(fused, ref) < 0.1
    # the same math: only the RMSNorms' sums of squares (and, on the GPU, rsqrt) differ
    assert rel(fused, unfused) < 2e-3


@pytest.mark.parametrize("attention_impl", ["auto", "pallas"])
def test_fused_fp8_layer_matches_unfused_model(monkeypatch, attention_impl):
    _fused_vs_unfused_model(monkeypatch, attention_impl)


@pytest.mark.gpu
def test_fused_fp8_layer_on_gpu(monkeypatch):
    _fused_vs_unfused_model(monkeypatch)
