"""The canonical flat parameter dict every loader returns and the model consumes.

Per-layer weights are stacked along a leading L axis; linear weights are [in, out] so that
y = x @ w; the Q/K output rows are in HF's rotate_half RoPE layout (first half of each head's
D = real parts, second half = imaginary parts).
"""
from __future__ import annotations

from typing import Mapping

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ModelLoadError

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "mlp_norm",
                "w_gate", "w_up", "w_down")


FP8_LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
SCALE_SUFFIX = "_scale"


def is_fp8(params: Mapping) -> bool:
    """Whether a flat dict holds FP8-quantized linears (checkpoints.fp8.quantize_params)."""
    return "wq" + SCALE_SUFFIX in params


def has_int8_head(params: Mapping) -> bool:
    """Whether a flat dict holds an int8 LM head (checkpoints.fp8.quantize_int8_linear)."""
    return "lm_head" + SCALE_SUFFIX in params


def param_shapes(cfg: ModelConfig, fp8: bool = False,
                 int8_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter `cfg` needs (biases only for qkv_bias, lm_head only
    when the embeddings are not tied). With fp8, the decoder linears are e4m3 [L, out, in]
    with f32 per-output-channel scales `name_scale` [L, out] (see checkpoints/fp8.py). With
    int8_head, lm_head is int8 codes [V, E] with f32 per-vocab-row scales lm_head_scale [V],
    tied embeddings or not."""
    v, e, f, l = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.q_size, cfg.kv_size
    shapes = {
        "embed": (v, e),                # [V, E]
        "final_norm": (e,),             # [E]
        "attn_norm": (l, e),            # [L, E]
        "wq": (l, e, q),                # [L, E, H*D]
        "wk": (l, e, kv),               # [L, E, K*D]
        "wv": (l, e, kv),               # [L, E, K*D]
        "wo": (l, q, e),                # [L, H*D, E]
        "mlp_norm": (l, e),             # [L, E]
        "w_gate": (l, e, f),            # [L, E, F]
        "w_up": (l, e, f),              # [L, E, F]
        "w_down": (l, f, e),            # [L, F, E]
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (e, v)      # [E, V]
    if cfg.qkv_bias:
        shapes.update(bq=(l, q), bk=(l, kv), bv=(l, kv))
    if fp8:
        for name in FP8_LINEARS:
            shapes[name] = shapes[name][:-2] + shapes[name][:-3:-1]   # [L, out, in]
            shapes[name + SCALE_SUFFIX] = shapes[name][:-1]           # [L, out]
    if int8_head:
        shapes.update(lm_head=(v, e), lm_head_scale=(v,))
    return shapes


def check_params(cfg: ModelConfig, params: Mapping, source: str) -> None:
    """Raise ModelLoadError naming every missing, unexpected or mis-shaped parameter."""
    want = param_shapes(cfg, is_fp8(params), has_int8_head(params))
    problems = [f"missing {k} {s}" for k, s in want.items() if k not in params]
    problems += [f"unexpected {k}" for k in params if k not in want]
    problems += [f"{k} has shape {tuple(params[k].shape)}, expected {s}"
                 for k, s in want.items() if k in params and tuple(params[k].shape) != s]
    if problems:
        raise ModelLoadError(f"{source}: weights do not match the model config "
                             f"({cfg.name}): " + "; ".join(problems))
