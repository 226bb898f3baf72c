"""Load a llama.cpp GGUF file into (ModelConfig, canonical flat params).

Quantized tensors (Q4_1, Q8_0, ...) are dequantized on the host with `gguf.quants.dequantize`.
Two layout facts matter:
- ggml lists dims fastest-first, so a linear weight of ggml shape [in, out] arrives in numpy as
  [out, in] -- the same as HF's nn.Linear weight -- and is transposed to our [in, out].
- llama.cpp's converter permutes the Q and K rows of llama-architecture models so each head's
  rotary pairs are adjacent (interleaved RoPE). We undo that per head so HF's rotate_half RoPE
  applies. Qwen2 files are written unpermuted (its converter skips the permute).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from checkpoints.params import check_params
from jaxinfer.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from jaxinfer.errors import ConfigError, ModelLoadError

# GGUF tensor suffix (after "blk.N.") -> canonical name, and whether it is a linear weight.
_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "attn_output.weight": ("wo", True),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}
_PERMUTED_ARCHS = ("llama",)


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` for `path`, or ModelLoadError saying why not."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct.error/... on bad bytes
        raise ModelLoadError(f"{path} is not a valid GGUF file ({type(e).__name__}: {e})") from None


def meta(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """[n_heads*D, in] rows from llama.cpp's interleaved order (re0, im0, re1, im1, ...) per head
    back to HF's half-split order (re0.., im0..). Inverse of the converter's
    `w.reshape(n, 2, D/2, in).swapaxes(1, 2)`."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader, name: str) -> ModelConfig:
    arch = meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {arch!r} in GGUF (general.architecture); "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def req(key):
        value = meta(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
        return value

    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    head_dim = int(meta(reader, f"{arch}.attention.key_length") or hidden // heads)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelLoadError("GGUF has no token_embd.weight tensor")
    vocab = int(embed.shape[-1])  # ggml order [E, V]; may exceed the token list (padding)
    eos = [meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    theta = float(meta(reader, f"{arch}.rope.freq_base", 10000.0))
    return ModelConfig(
        name=name, architecture=arch, vocab_size=vocab, hidden_size=hidden,
        num_layers=int(req("block_count")), num_heads=heads,
        num_kv_heads=int(meta(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim, intermediate_size=int(req("feed_forward_length")),
        max_position_embeddings=int(req("context_length")), rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, head_dim, theta),
        # stored as float32: round so 1e-5 reads back as 1e-5, not 9.9999997e-06
        rms_norm_eps=float(f"{float(req('attention.layer_norm_rms_epsilon')):.6g}"),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        qkv_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        bos_token_id=meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def _llama3_factors(s: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """The per-frequency divisors Llama-3 scaling applies (what llama.cpp stores as rope_freqs)."""
    freqs = theta ** -(np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, s.factor, mid))


def _rope_scaling(reader, arch: str, head_dim: int, theta: float) -> RopeScaling | None:
    """llama.cpp stores Llama-3 scaling only as a `rope_freqs.weight` tensor of factors: match it
    against the published Llama-3.x settings rather than guess."""
    kind = meta(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ConfigError(f"unsupported GGUF rope scaling type {kind!r}")
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    stored = np.asarray(tensor.data, np.float64).reshape(-1)
    for factor in (8.0, 16.0, 32.0):
        candidate = RopeScaling(factor, 1.0, 4.0, 8192)
        if np.allclose(_llama3_factors(candidate, head_dim, theta), stored, rtol=1e-3):
            return candidate
    raise ConfigError("GGUF rope_freqs.weight does not match any known Llama-3 rope scaling")


def _canonical(reader, cfg: ModelConfig, dtype) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    layers: dict[str, list] = {}
    params: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        name = t.name
        if name.startswith("blk."):
            _, idx, suffix = name.split(".", 2)
            if suffix not in _LAYER_TENSORS:
                raise ModelLoadError(f"unexpected GGUF tensor {name}")
            key, linear = _LAYER_TENSORS[suffix]
            if cfg.architecture in _PERMUTED_ARCHS and key in ("wq", "wk"):
                w = unpermute_rope_rows(w, cfg.num_heads if key == "wq" else cfg.num_kv_heads)
            layers.setdefault(key, [None] * cfg.num_layers)[int(idx)] = w.T if linear else w
        elif name == "token_embd.weight":
            params["embed"] = w.astype(dtype)                      # [V, E]
        elif name == "output.weight":
            params["lm_head"] = np.ascontiguousarray(w.T, dtype)   # [E, V]
        elif name == "output_norm.weight":
            params["final_norm"] = w.astype(dtype)
        elif name != "rope_freqs.weight":
            raise ModelLoadError(f"unexpected GGUF tensor {name}")
    for key, per_layer in layers.items():
        if any(x is None for x in per_layer):
            raise ModelLoadError(f"GGUF is missing {key} for some layers")
        params[key] = np.stack(per_layer).astype(dtype, copy=False)
    return params


def gguf_model_name(reader, path: Path) -> str:
    base, size = meta(reader, "general.basename"), meta(reader, "general.size_label")
    return f"{base}-{size}".lower() if base and size else path.stem


def load_gguf(path: str | Path, dtype=np.float32, reader=None):
    """(ModelConfig, params) from a GGUF file; params are numpy arrays of `dtype`. Pass an
    already open `reader` (from `open_gguf`) to parse the file once for weights and tokenizer."""
    path = Path(path)
    reader = reader or open_gguf(path)
    cfg = config_from_gguf(reader, gguf_model_name(reader, path))
    params = _canonical(reader, cfg, dtype)
    check_params(cfg, params, str(path))
    return cfg, params
