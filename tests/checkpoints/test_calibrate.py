"""Calibrated FP8 rounding (checkpoints/calibrate.py): the same format and scales as
round-to-nearest, less output error on correlated inputs, a calibration forward that agrees
with the independent dense reference, and calibration text that is not the quality test's."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from pydoc_data.topics import topics

from checkpoints.calibrate import _layer_grams, calibration_text, gptq_linear
from checkpoints.fp8 import dequantize_linear, quantize_linear
from dense_reference import dense_logits, random_flat
from checkpoints.gguf_tokenizer import gguf_tokenizer
from jaxinfer.cli import main
from jaxinfer.config import standard_config


def _deq(w_q, scale):
    return np.asarray(dequantize_linear(jnp.asarray(w_q), jnp.asarray(scale)))


def test_without_input_correlation_it_is_round_to_nearest():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 24)).astype(np.float32)
    gram = np.diag(rng.uniform(0.5, 2.0, 48))      # independent inputs: nothing to compensate
    w_q, scale = gptq_linear(w, gram)
    rtn_q, rtn_scale = quantize_linear(jnp.asarray(w))
    np.testing.assert_array_equal(scale, np.asarray(rtn_scale))
    np.testing.assert_array_equal(np.asarray(w_q, np.float32), np.asarray(rtn_q, np.float32))


@pytest.mark.parametrize("act_order", [False, True])
def test_correlated_inputs_cut_the_output_error(act_order):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.standard_normal((512, 16)) @ rng.standard_normal((16, 64))   # rank-16 inputs
    x += 0.05 * rng.standard_normal(x.shape)
    w_q, scale = gptq_linear(w, x.T @ x, act_order=act_order)
    assert w_q.dtype == jnp.float8_e4m3fn and w_q.shape == (32, 64) and scale.shape == (32,)
    rtn = _deq(*quantize_linear(jnp.asarray(w)))
    err_rtn = np.sum((x @ (w - rtn)) ** 2)
    err_gptq = np.sum((x @ (w - _deq(w_q, scale))) ** 2)
    assert err_gptq < 0.5 * err_rtn, (err_gptq, err_rtn)


def _gptq_row_by_row(w, gram, damp=0.001):
    """GPTQ without blocks (act_order on): each row's error update applied to every later
    row at once, the plain statement of what gptq_linear computes in groups."""
    w = np.asarray(w, np.float64)
    n = w.shape[0]
    scale = np.asarray(quantize_linear(jnp.asarray(w, jnp.float32))[1], np.float64)
    g = np.array(gram, np.float64)
    dead = np.diag(g) == 0
    g[dead, dead] = 1.0
    order = np.argsort(-np.diag(g), kind="stable")
    w, g = w[order].copy(), g[np.ix_(order, order)]
    g[np.diag_indices(n)] += damp * np.mean(np.diag(g))
    u = np.linalg.cholesky(np.linalg.inv(g)).T
    q8 = np.zeros_like(w)
    for i in range(n):
        q8[i] = np.clip(w[i] / scale, -448, 448).astype(jnp.float8_e4m3fn).astype(np.float64)
        w[i + 1:] -= np.outer(u[i, i + 1:], (w[i] - q8[i] * scale) / u[i, i])
    return q8[np.argsort(order)].T


@pytest.mark.parametrize("block,inner", [(128, 16), (32, 8), (40, 7), (200, 200)])
def test_blocked_updates_give_the_row_by_row_result(block, inner):
    """The grouped updates (inner groups, blocks; a block and groups not dividing the rows
    too) round every weight as the row-by-row statement does."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((150, 40)).astype(np.float32)
    x = rng.standard_normal((600, 24)) @ rng.standard_normal((24, 150))
    x += 0.05 * rng.standard_normal(x.shape)
    w_q, _ = gptq_linear(w, x.T @ x, block=block, inner=inner)
    want = _gptq_row_by_row(w, x.T @ x)
    got = np.asarray(w_q, np.float32)
    assert np.mean(got != want) < 1e-3, np.mean(got != want)


def test_inverse_cholesky_factor_without_the_inverse():
    """U upper with U^T U = inv(G), as cholesky(inv(G)).T, also where the triangular inverse
    recurses on uneven halves (300 -> 150 -> 75)."""
    from checkpoints.calibrate import _inverse_cholesky_upper

    rng = np.random.default_rng(5)
    for n in (40, 300):
        x = rng.standard_normal((3 * n, n))
        g = x.T @ x + 0.01 * np.eye(n)
        u = _inverse_cholesky_upper(g)
        assert np.array_equal(u, np.triu(u))
        np.testing.assert_allclose(u.T @ u @ g, np.eye(n), atol=1e-8)
        np.testing.assert_allclose(u, np.linalg.cholesky(np.linalg.inv(g)).T,
                                   rtol=1e-9, atol=1e-12)


def test_linears_of_one_input_rounded_together_as_apart(monkeypatch):
    """calibrated_quantize_params rounds wq|wk|wv and w_gate|w_up as one matrix each: every
    code and scale as when each linear is rounded on its own."""
    from checkpoints import calibrate

    class Ids:    # a stand-in tokenizer: the calibration text's bytes as ids
        def encode(self, text):
            return [b % cfg.vocab_size for b in text.encode()]

    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=6)
    together = calibrate.calibrated_quantize_params(cfg, flat, Ids(), num_windows=2,
                                                    window=32)
    monkeypatch.setattr(calibrate, "SHARED_INPUT", ())
    apart = calibrate.calibrated_quantize_params(cfg, flat, Ids(), num_windows=2, window=32)
    assert sorted(together) == sorted(apart)
    for name in calibrate.LINEAR_NAMES:
        assert together[name].shape == apart[name].shape == flat[name].shape[:1] + \
            flat[name].shape[:0:-1]
        np.testing.assert_array_equal(np.asarray(together[name], np.float32),
                                      np.asarray(apart[name], np.float32), err_msg=name)
        np.testing.assert_array_equal(together[name + "_scale"], apart[name + "_scale"])


def test_gram_shape_is_checked():
    with pytest.raises(ValueError, match="gram"):
        gptq_linear(np.ones((8, 4), np.float32), np.eye(4))


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_calibration_forward_matches_the_dense_reference(qkv_bias):
    cfg = dataclasses.replace(standard_config("tiny"), qkv_bias=qkv_bias)
    flat = random_flat(cfg, seed=3)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, 24)
    x = jnp.asarray(flat["embed"][tokens])
    keys = ["attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"] + (
        ["bq", "bk", "bv"] if qkv_bias else [])
    for layer in range(cfg.num_layers):
        x, grams = _layer_grams(cfg, {k: jnp.asarray(flat[k][layer]) for k in keys}, x)
        assert grams["attn_in"].shape == (cfg.hidden_size, cfg.hidden_size)
        assert grams["down_in"].shape == (cfg.intermediate_size,) * 2
    x = np.asarray(x, np.float64)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * flat["final_norm"]
    head = flat["embed"].T if cfg.tie_word_embeddings else flat["lm_head"]
    np.testing.assert_allclose(x @ head, dense_logits(cfg, flat, tokens), rtol=2e-3, atol=2e-3)


def test_calibration_text_is_not_the_judged_text():
    text = calibration_text()
    assert len(text) > 100_000
    judged = [t[i:i + 80] for t in topics.values() for i in range(0, len(t) - 80, 400)]
    assert judged and not any(chunk in text for chunk in judged)


def test_convert_calibrate_needs_fp8_and_a_tokenizer(tmp_path):
    assert main(["convert", "smollm2", str(tmp_path / "a"), "--calibrate"]) == 2
    assert main(["convert", "tiny", str(tmp_path / "b"), "--weights", "fp8",
                 "--calibrate"]) == 2
    assert main(["convert", "smollm2", str(tmp_path / "c"), "--weights", "fp8", "--calibrate",
                 "--calibration-windows", "0"]) == 2
    assert not any((tmp_path / d).exists() for d in "abc")


def test_too_many_windows_is_a_clear_error():
    from checkpoints import default_gguf_path
    from checkpoints.calibrate import calibration_windows

    tok = gguf_tokenizer(default_gguf_path())
    assert calibration_windows(tok, 2, 64).shape == (2, 64)
    with pytest.raises(ValueError, match="calibration text has"):
        calibration_windows(tok, 10_000, 512)
