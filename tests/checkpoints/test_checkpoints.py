"""Checkpoint loading: GGUF (vs HF transformers' own GGUF loader), HF safetensors dirs, orbax
round trips, synthetic weights, and clear errors for bad input."""
import json

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints import default_gguf_path, load_checkpoint, orbax_io
from checkpoints.gguf_loader import _LAYER_TENSORS as GGUF_LAYER_TENSORS
from checkpoints.gguf_loader import load_gguf, open_gguf, unpermute_rope_rows
from checkpoints.hf_loader import load_hf_dir
from checkpoints.params import param_shapes
from checkpoints.synthetic import synthetic_params
from checkpoints.gguf_tokenizer import gguf_tokenizer
from jaxinfer.config import ModelConfig, RopeScaling, standard_config
from jaxinfer.errors import ConfigError, ModelLoadError

from checkpoints_util import HF_LINEAR, HF_VECTOR, tiny_hf_config as _tiny_cfg
from checkpoints_util import write_hf_dir as _write_hf_dir


@pytest.fixture(scope="module")
def reader():
    return open_gguf(default_gguf_path())


@pytest.fixture(scope="module")
def smollm(reader):
    cfg, params = load_gguf(default_gguf_path(), reader=reader)
    return cfg, params, gguf_tokenizer(reader)


@pytest.fixture(scope="module")
def hf_state_dict():
    import torch
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_gguf_config_and_shapes(smollm):
    cfg, params, tok = smollm
    ref = standard_config("smollm2-135m")
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "intermediate_size", "max_position_embeddings",
                  "rope_theta", "rms_norm_eps", "tie_word_embeddings", "qkv_bias",
                  "bos_token_id", "eos_token_ids"):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert {k: v.shape for k, v in params.items()} == param_shapes(cfg)
    assert "lm_head" not in params and all(v.dtype == np.float32 for v in params.values())
    assert all(np.isfinite(v).all() for v in params.values())
    assert tok is not None and tok.eos_token_ids == (2,)


def test_gguf_weights_match_hf_transformers(smollm, hf_state_dict):
    _, params, _ = smollm
    sd = hf_state_dict
    np.testing.assert_array_equal(params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], sd["model.norm.weight"])
    for layer in range(params["wq"].shape[0]):
        pre = f"model.layers.{layer}."
        for ours, theirs in HF_LINEAR.items():
            np.testing.assert_allclose(params[ours][layer], sd[pre + theirs + ".weight"].T,
                                       atol=1e-6, err_msg=f"{ours} layer {layer}")
        for ours in ("attn_norm", "mlp_norm"):
            np.testing.assert_allclose(params[ours][layer], sd[pre + HF_VECTOR[ours]], atol=1e-6)


def test_unpermute_is_needed(reader, hf_state_dict):
    """Guard against the test above passing vacuously: the file's own Q/K rows differ from
    HF's, and un-permuting them per head (9 q heads, 3 kv heads) gives HF's exactly."""
    tensors = {t.name: t for t in reader.tensors}
    for name, hf_name, n_heads in [("attn_q", "q_proj", 9), ("attn_k", "k_proj", 3)]:
        t = tensors[f"blk.3.{name}.weight"]
        raw = gguf.quants.dequantize(t.data, t.tensor_type)        # [heads*D, E]
        hf = hf_state_dict[f"model.layers.3.self_attn.{hf_name}.weight"]
        assert np.abs(raw - hf).max() > 1e-2
        np.testing.assert_array_equal(unpermute_rope_rows(raw, n_heads), hf)


def _rope_interleaved(x, pos, theta):
    """llama.cpp's RoPE: rotates adjacent pairs (x[2i], x[2i+1]). x: [T, D]."""
    d = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, d, 2) / d)
    re, im = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2] = re * np.cos(ang) - im * np.sin(ang)
    out[:, 1::2] = re * np.sin(ang) + im * np.cos(ang)
    return out


def _rope_half(x, pos, theta):
    """HF's rotate_half RoPE: rotates (x[i], x[i + D/2]). x: [T, D]."""
    d = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rotated = np.concatenate([-x[:, d // 2:], x[:, : d // 2]], -1)
    return x * cos + rotated * sin


def test_unpermute_turns_interleaved_rope_into_rotate_half():
    """Independent of HF: attention scores of llama.cpp's RoPE on the file's rows equal those of
    rotate_half RoPE on the un-permuted rows."""
    rng = np.random.default_rng(0)
    n_heads, d, e, t = 3, 16, 24, 7
    w_file = rng.standard_normal((n_heads * d, e))          # [K*D, E], llama.cpp row order
    x, pos = rng.standard_normal((t, e)), rng.integers(0, 500, t).astype(np.float64)
    ours = x @ unpermute_rope_rows(w_file, n_heads).T
    theirs = x @ w_file.T
    for h in range(n_heads):
        a = _rope_half(ours[:, h * d:(h + 1) * d], pos, 1e4)
        b = _rope_interleaved(theirs[:, h * d:(h + 1) * d], pos, 1e4)
        np.testing.assert_allclose(a @ a.T, b @ b.T, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("model_type,dtype,shards", [
    ("llama", np.float32, 1), ("qwen2", ml_dtypes.bfloat16, 3)])
def test_hf_dir_round_trip(tmp_path, model_type, dtype, shards):
    rng = np.random.default_rng(1)
    want = _write_hf_dir(tmp_path, _tiny_cfg(model_type=model_type), rng, dtype, shards)
    cfg, params = load_hf_dir(tmp_path)
    assert cfg.qkv_bias == (model_type == "qwen2") and set(params) == set(want)
    for k in want:
        np.testing.assert_array_equal(params[k], want[k], err_msg=k)


def test_orbax_round_trip_with_tokenizer(tmp_path, smollm):
    tok = smollm[2]
    cfg = standard_config("tiny")
    params = synthetic_params(cfg, "bfloat16", seed=3)
    orbax_io.save(tmp_path / "ckpt", cfg, params, tokenizer=tok)
    cfg2, params2, tok2 = load_checkpoint(tmp_path / "ckpt")
    assert cfg2 == cfg and set(params2) == set(params)
    for k in params:
        assert params2[k].dtype == params[k].dtype
        np.testing.assert_array_equal(np.asarray(params2[k]), np.asarray(params[k]))
    text = "<|im_start|>user\nHéllo 😀<|im_end|>"
    assert tok2.encode(text) == tok.encode(text) and tok2.chat_template == tok.chat_template
    assert tok2.eos_token_ids == tok.eos_token_ids and tok2.bos_token_id == tok.bos_token_id


def test_synthetic_params():
    cfg = standard_config("tiny")
    a = synthetic_params(cfg, "float32", seed=0)
    assert {k: v.shape for k, v in a.items()} == param_shapes(cfg)
    assert all(isinstance(v, jax.Array) and v.dtype == np.float32 for v in a.values())
    assert float(a["attn_norm"].min()) == float(a["attn_norm"].max()) == 1.0
    assert abs(float(a["wq"].std()) - 0.02) < 0.002
    b = load_checkpoint("tiny", "float32", seed=0)[1]
    c = synthetic_params(cfg, "float32", seed=1)
    np.testing.assert_array_equal(np.asarray(a["w_up"]), np.asarray(b["w_up"]))
    assert not np.allclose(np.asarray(a["w_up"]), np.asarray(c["w_up"]))


def test_synthetic_params_fp8():
    """FP8 synthetic weights come quantized: checkpoints/fp8.py's layout, ~N(0, 0.02) once
    dequantized, the rest as in the float dict."""
    from checkpoints.fp8 import dequantize_linear
    from checkpoints.params import FP8_LINEARS, is_fp8

    cfg = standard_config("tiny")
    a = synthetic_params(cfg, "bfloat16", seed=0, fp8=True)
    assert is_fp8(a)
    assert {k: v.shape for k, v in a.items()} == param_shapes(cfg, fp8=True)
    for name in FP8_LINEARS:
        assert a[name].dtype == jnp.float8_e4m3fn and a[name + "_scale"].dtype == np.float32
        w = np.asarray(dequantize_linear(a[name], a[name + "_scale"]))
        assert abs(float(w.std()) - 0.02) < 0.003, name
        assert not np.allclose(w[0], w[1])                 # layers are not copies
    assert a["embed"].dtype == jnp.bfloat16 and float(a["mlp_norm"].min()) == 1.0
    b = load_checkpoint("tiny", "bfloat16", seed=0, fp8=True)[1]
    np.testing.assert_array_equal(np.asarray(a["w_up"], np.float32), np.asarray(b["w_up"], np.float32))


def test_synthetic_fp8_scratch_is_one_layer():
    """Qwen2.5-32B's gate projection: the generator's scratch is a few times one layer's
    float32 sample (566 MB; the CPU's random bits and the transpose take ~6 of them), never
    in proportion to the 64 layers (the bf16 stack alone is 18 GB)."""
    from checkpoints.synthetic import _fp8_generator

    cfg = standard_config("qwen2.5-32b")
    compiled = _fp8_generator(cfg, "w_gate", None).lower(jax.random.PRNGKey(0)).compile()
    layer_f32 = cfg.hidden_size * cfg.intermediate_size * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 8 * layer_f32


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "qwen2.5-32b", "smollm2-135m"])
def test_synthetic_shapes_of_standard_configs(name):
    cfg = standard_config(name)
    shapes = jax.eval_shape(lambda: synthetic_params(cfg, "bfloat16"))  # allocates nothing
    assert {k: v.shape for k, v in shapes.items()} == param_shapes(cfg)
    assert sum(np.prod(v.shape) for v in shapes.values()) == cfg.param_count()


def _llama_cpp_permute(w, n_heads):
    """What llama.cpp's converter does to HF Q/K rows (written from its description)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_divisors(d, theta):
    """inv_freq / Llama-3-scaled inv_freq (factor 8, low 1, high 4, original 8192), HF style."""
    inv = theta ** -(np.arange(0, d, 2) / d)
    wavelen = 2 * np.pi / inv
    smooth = (8192 / wavelen - 1) / (4 - 1)
    scaled = np.where(wavelen > 8192, inv / 8,
                      np.where(wavelen < 2048, inv, (1 - smooth) * inv / 8 + smooth * inv))
    return inv / scaled


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path, arch):
    """Untied lm_head, qwen2 biases, and llama-only Q/K permutation, through a written GGUF."""
    cfg = ModelConfig.from_hf_dict(_tiny_cfg(model_type=arch))
    rng = np.random.default_rng(4)
    want = {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(cfg).items()}
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    for key, value in [("context_length", 2048), ("embedding_length", 64), ("block_count", 2),
                       ("feed_forward_length", 128), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 5e5)
    w.add_tensor("token_embd.weight", want["embed"])
    w.add_tensor("output.weight", np.ascontiguousarray(want["lm_head"].T))
    w.add_tensor("output_norm.weight", want["final_norm"])
    if arch == "llama":  # llama.cpp keeps Llama-3 rope scaling only as this tensor
        w.add_tensor("rope_freqs.weight", _llama3_rope_divisors(16, 5e5).astype(np.float32))
    names = {v: k for k, (v, _) in GGUF_LAYER_TENSORS.items()}
    for layer in range(cfg.num_layers):
        for key in [k for k in want if k in names]:
            x = want[key][layer]
            if x.ndim == 2:
                x = x.T
                if arch == "llama" and key in ("wq", "wk"):
                    x = _llama_cpp_permute(x, 4 if key == "wq" else 2)
            w.add_tensor(f"blk.{layer}.{names[key]}", np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got_cfg, got = load_gguf(tmp_path / "m.gguf")
    assert (got_cfg.vocab_size, got_cfg.tie_word_embeddings, got_cfg.qkv_bias) == (512, False, arch == "qwen2")
    assert (got_cfg.rope_theta, got_cfg.rms_norm_eps, got_cfg.head_dim) == (5e5, 1e-6, 16)
    assert got_cfg.rope_scaling == (RopeScaling(8.0, 1.0, 4.0, 8192) if arch == "llama" else None)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _write_gguf(path, arch, tokenizer_model="gpt2"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_string("tokenizer.ggml.model", tokenizer_model)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_inputs(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="no model at"):
        load_checkpoint(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="standard shape"):
        load_checkpoint("llama-9-9b")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        load_checkpoint(garbage)
    _write_gguf(tmp_path / "falcon.gguf", "falcon")
    with pytest.raises(ConfigError, match="unsupported architecture 'falcon'"):
        load_gguf(tmp_path / "falcon.gguf")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(_tiny_cfg(model_type="gpt_neox")))
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt_neox'"):
        load_hf_dir(tmp_path / "hf")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_dir(tmp_path)


def test_hf_dir_shape_mismatch_is_named(tmp_path):
    _write_hf_dir(tmp_path, _tiny_cfg(), np.random.default_rng(2))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_cfg(intermediate_size=96)))
    with pytest.raises(ModelLoadError, match=r"w_gate has shape \(2, 64, 128\), expected \(2, 64, 96\)"):
        load_hf_dir(tmp_path)
