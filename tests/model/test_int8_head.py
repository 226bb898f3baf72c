"""The int8 LM head: codes per vocab row with max/127 scales (checkpoints.fp8), its GEMV
(ops.int8_head), the model and loaders that carry it, and its calibrated rounding
(checkpoints/calibrate.py). Its answer quality on SmolLM2 is
tests/checkpoints/test_fp8_quality.py's."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.calibrate import gptq_linear
from checkpoints.fp8 import quantize_int8_linear
from jaxinfer import ops
from jaxinfer.config import EngineConfig
from jaxinfer.errors import ConfigError, ModelLoadError
from jaxinfer.loading import load_model
from jaxinfer.routes import Routes


def _deq(codes, scale):
    """codes [V, E] int8, scale [V] -> w [E, V] f32."""
    return (np.asarray(codes, np.float32) * np.asarray(scale, np.float32)[:, None]).T


def test_round_to_nearest_codes_and_scales():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 24)).astype(np.float32)            # [E, V]
    w[:, 3] = 0.0                                                   # an all-zero vocab row
    codes, scale = quantize_int8_linear(jnp.asarray(w))
    assert codes.dtype == jnp.int8 and codes.shape == (24, 40) and scale.shape == (24,)
    np.testing.assert_allclose(np.asarray(scale)[[0, 5]], np.abs(w).max(0)[[0, 5]] / 127,
                               rtol=1e-6)
    assert float(scale[3]) == 1.0 and not np.asarray(codes)[3].any()
    assert np.abs(np.asarray(codes)).max() == 127
    err = np.abs(_deq(codes, scale) - w)
    assert (err <= np.asarray(scale)[None, :] / 2 + 1e-6).all()    # within half a step


@pytest.mark.parametrize("m", [1, 3, 8, 20])
def test_int8_head_gemv_matches_its_dequantized_weight(m):
    rng = np.random.default_rng(m)
    w = rng.standard_normal((64, 200)).astype(np.float32)
    codes, scale = quantize_int8_linear(jnp.asarray(w))
    x = jnp.asarray(rng.standard_normal((m, 64)), jnp.float32)
    got = ops.int8_head(x, codes, scale, Routes())
    assert got.shape == (m, 200) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ _deq(codes, scale),
                               rtol=1e-5, atol=1e-4)


def test_gptq_int8_format_and_less_output_error():
    """Calibrated int8: the round-to-nearest scales, int8 codes, and less output error than
    round-to-nearest on correlated inputs (as the FP8 form's test in test_calibrate.py)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    x = rng.standard_normal((512, 16)) @ rng.standard_normal((16, 64))
    x += 0.05 * rng.standard_normal(x.shape)
    codes, scale = gptq_linear(w, x.T @ x, fmt="int8")
    rtn_codes, rtn_scale = quantize_int8_linear(jnp.asarray(w))
    assert codes.dtype == np.int8 and codes.shape == (48, 64)
    np.testing.assert_array_equal(scale, np.asarray(rtn_scale))
    err_rtn = np.sum((x @ (w - _deq(rtn_codes, rtn_scale))) ** 2)
    err = np.sum((x @ (w - _deq(codes, scale))) ** 2)
    assert err < 0.5 * err_rtn, (err, err_rtn)
    with pytest.raises(ValueError, match="fmt"):
        gptq_linear(w, x.T @ x, fmt="int4")


def _engine(lm_head):
    return EngineConfig(dtype="float32", lm_head=lm_head, max_model_len=64, max_num_seqs=2)


@pytest.mark.parametrize("model", ["tiny", "smollm2"])     # untied head, tied embedding
def test_model_logits_with_the_int8_head(model):
    from flax import nnx

    logits = {}
    for head in ("bf16", "int8"):
        cfg, graphdef, params, _ = load_model(model, _engine(head))
        h = jax.random.normal(jax.random.PRNGKey(0), (3, cfg.hidden_size))
        decoder = nnx.merge(graphdef, params)
        if head == "int8":
            assert decoder.lm_head.kernel.dtype == jnp.int8
            assert decoder.lm_head.kernel.shape == (cfg.vocab_size, cfg.hidden_size)
            assert decoder.embed.shape == (cfg.vocab_size, cfg.hidden_size)   # still there
        logits[head] = np.asarray(decoder.logits(h))
    ref, got = logits["bf16"], logits["int8"]
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 1e-4 < rel < 0.02, rel          # quantized (not bf16's result), and close


def _reads_codes(decoder, h) -> bool:
    """Whether logits(h) widens the int8 codes (ops.int8_head) rather than reading a float
    head: by the traced program's types."""
    return "i8[" in str(jax.make_jaxpr(decoder.logits)(h))


def test_auto_head_reads_codes_up_to_the_row_limit_and_its_dense_copy_above(monkeypatch):
    """lm_head="auto": the int8 head's codes for steps of up to INT8_HEAD_MAX_ROWS rows (the
    same logits as lm_head="int8"), and above them a float copy of the same codes times
    their scales, whose logits agree with the codes' to float rounding."""
    from flax import nnx

    from jaxinfer import config

    monkeypatch.setattr(config, "INT8_HEAD_MAX_ROWS", 2)
    decoders = {}
    for head in ("int8", "auto"):
        cfg, graphdef, params, _ = load_model("tiny", _engine(head))
        decoders[head] = nnx.merge(graphdef, params)
    int8, auto = decoders["int8"], decoders["auto"]
    assert not hasattr(int8, "lm_head_dense")
    codes, scale = int8.lm_head.kernel[...], int8.lm_head.scale[...]
    np.testing.assert_array_equal(np.asarray(auto.lm_head.kernel[...]), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(auto.lm_head_dense[...]),
                                  _deq(codes, scale).T)
    h = jax.random.normal(jax.random.PRNGKey(1), (3, cfg.hidden_size))
    assert _reads_codes(auto, h[:2]) and not _reads_codes(auto, h)
    assert _reads_codes(int8, h)
    np.testing.assert_array_equal(np.asarray(auto.logits(h[:2])),
                                  np.asarray(int8.logits(h[:2])))
    np.testing.assert_allclose(np.asarray(auto.logits(h)), np.asarray(int8.logits(h)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:lm_head='int8'")     # the patched row limit's warning
def test_auto_head_through_the_engine(monkeypatch):
    """Greedy answers with lm_head="auto" where the steps' buckets (4 rows) are above the
    row limit (patched to 1), so every step reads the dense copy: the int8 head's tokens."""
    from engine_util import random_prompts, run_staggered
    from jaxinfer import config
    from jaxinfer.engine import Engine
    from jaxinfer.request import SamplingParams

    monkeypatch.setattr(config, "INT8_HEAD_MAX_ROWS", 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(3, hi=12, seed=2)
    tokens = {}
    for head in ("int8", "auto"):
        engine = Engine.from_model("tiny", EngineConfig(
            dtype="float32", lm_head=head, max_model_len=64, max_num_seqs=4,
            max_num_batched_tokens=16, page_size=4))
        outs = run_staggered(engine, prompts, [greedy] * 3, [0, 0, 0])
        tokens[head] = [o.token_ids for o in outs]
    assert tokens["auto"] == tokens["int8"] and all(len(t) == 6 for t in tokens["int8"])


def test_decode_bench_counts_the_head_a_step_reads():
    """bench.decode's byte count (its MBU's numerator) with lm_head="auto": the codes and
    scales up to INT8_HEAD_MAX_ROWS rows, the dense copy above, never both."""
    from jaxinfer.roofline import weight_bytes
    from jaxinfer.config import INT8_HEAD_MAX_ROWS

    cfg, _, int8, _ = load_model("tiny", _engine("int8"))
    _, _, auto, _ = load_model("tiny", _engine("auto"))
    head = cfg.vocab_size * cfg.hidden_size
    codes_and_scales = head + 4 * cfg.vocab_size
    for rows in (1, INT8_HEAD_MAX_ROWS):
        assert weight_bytes(auto, cfg, rows, "auto") == weight_bytes(int8, cfg, rows, "int8")
    rows = INT8_HEAD_MAX_ROWS + 1
    assert (weight_bytes(auto, cfg, rows, "auto")
            == weight_bytes(int8, cfg, rows, "int8") - codes_and_scales + 4 * head)  # f32


def test_lm_head_config_is_checked():
    with pytest.raises(ConfigError, match="lm_head"):
        EngineConfig(lm_head="fp8")


def test_int8_head_at_large_batches_warns():
    """Above INT8_HEAD_MAX_ROWS sequences a step the int8 head is the slower one on the H200:
    the config says so; at or under it, and with the bf16 head, nothing is said."""
    from jaxinfer.config import INT8_HEAD_MAX_ROWS

    with pytest.warns(UserWarning, match="int8 head is slower"):
        EngineConfig(lm_head="int8", max_num_seqs=INT8_HEAD_MAX_ROWS + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineConfig(lm_head="int8", max_num_seqs=INT8_HEAD_MAX_ROWS)
        EngineConfig(lm_head="bf16", max_num_seqs=512)
        EngineConfig(lm_head="auto", max_num_seqs=512)


def test_converted_int8_head_round_trip(tmp_path):
    """`jaxinfer convert --lm-head int8` stores the head's codes and scales; they load back
    under lm_head="int8". An untied model's float head is gone from such a checkpoint, so
    lm_head="bf16" is a clear error (a tied one falls back to its embedding: the quality
    test loads its calibrated SmolLM2 both ways)."""
    from flax import nnx

    from checkpoints import load_checkpoint
    from jaxinfer.cli import main

    dst = tmp_path / "tiny_int8_head"
    assert main(["convert", "tiny", str(dst), "--lm-head", "int8"]) == 0
    _, params, _ = load_checkpoint(dst)
    src_cfg, src, _ = load_checkpoint("tiny", dtype="bfloat16")
    codes, scale = quantize_int8_linear(jnp.asarray(src["lm_head"], jnp.float32))
    assert params["lm_head"].dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(params["lm_head_scale"]), np.asarray(scale))
    cfg, graphdef, state, _ = load_model(str(dst), _engine("int8"))
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, state).lm_head.kernel[...]),
                                  np.asarray(codes))
    with pytest.raises(ModelLoadError, match="int8 LM head"):
        load_model(str(dst), _engine("bf16"))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 256])
def test_int8_head_on_the_gpu_reads_the_codes_in_the_gemm(m):
    """On the GPU the codes' widening stays inside XLA's GEMM: no buffer of the widened
    [V, E] weight in the compiled program (that would write and re-read twice the codes'
    bytes), and the result matches the dequantized weight's product."""
    assert jax.default_backend() == "gpu"
    e, v = 4096, 32768
    key = jax.random.PRNGKey(m)
    w = jax.random.normal(key, (e, v), jnp.float32) * 0.02
    codes, scale = quantize_int8_linear(w)
    x = jax.random.normal(jax.random.fold_in(key, 1), (m, e), jnp.bfloat16)
    from bench import hlo

    routes = Routes.choose(EngineConfig(), "gpu")
    fn = jax.jit(lambda x, codes, scale: ops.int8_head(x, codes, scale, routes))
    comps, _ = hlo.parse(fn.lower(x, codes, scale).compile().as_text())
    fused = {c for instrs in comps.values() for i in instrs if i.opcode == "fusion"
             for c in i.called("calls")}
    buffers = [i.line.strip()[:200] for name, instrs in comps.items() if name not in fused
               for i in instrs if re.search(rf"= (bf16|f32)\[{v},{e}\]", i.line)]
    assert not buffers, buffers
    want = np.asarray(x, np.float32) @ _deq(codes, scale)
    got = np.asarray(fn(x, codes, scale))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
