"""From a loader's canonical flat dict of weights to the NNX decoder's state.

The canonical names and shapes are checkpoints.params.param_shapes (what every loader
returns: stacked per layer, linears [in, out], or FP8 [out, in] + scales). The model fuses q/k/v and gate/up into single matmuls; that happens here, once, at load.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.fp8 import quantize_linear
from checkpoints.params import SCALE_SUFFIX, check_params
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ModelLoadError
from jaxinfer.model import Decoder, rope_inv_freq

def _cat(flat, names, axis=-1):
    arrs = [flat[n] for n in names]
    if all(isinstance(a, np.ndarray) for a in arrs):
        return np.concatenate(arrs, axis=axis)
    return jnp.concatenate([jnp.asarray(a) for a in arrs], axis=axis)


def _fused_linear(flat, names, fp8: bool) -> dict:
    """Fuse `names` along the output axis; FP8 ([L, out, in] + name_scale [L, out], from
    checkpoints.fp8) stays FP8, float weights are quantized here when fp8 is asked for."""
    if names[0] + SCALE_SUFFIX in flat:
        if not fp8:
            raise ModelLoadError("this checkpoint holds FP8 weights: load it with weights='fp8'")
        return {"kernel": _cat(flat, names, axis=-2),
                "scale": _cat(flat, [n + SCALE_SUFFIX for n in names])}
    kernel = _cat(flat, names)
    if not fp8:
        return {"kernel": kernel}
    pairs = [quantize_linear(jnp.asarray(w)) for w in kernel]   # per layer: bounded scratch
    return {"kernel": jnp.stack([p[0] for p in pairs]), "scale": jnp.stack([p[1] for p in pairs])}


def fused_tree(cfg: ModelConfig, flat: Mapping[str, object], fp8: bool = False) -> dict:
    """Canonical flat dict -> the nested dict of the Decoder's state (fused projections)."""
    check_params(cfg, flat, "checkpoint")
    wqkv = _fused_linear(flat, ("wq", "wk", "wv"), fp8)
    if cfg.qkv_bias:
        wqkv["bias"] = _cat(flat, ("bq", "bk", "bv"))
    tree = {
        "embed": flat["embed"],
        "final_norm": {"weight": flat["final_norm"]},
        "inv_freq": rope_inv_freq(cfg),
        "layers": {
            "attn_norm": {"weight": flat["attn_norm"]},
            "attn": {"wqkv": wqkv, "wo": _fused_linear(flat, ("wo",), fp8)},
            "mlp_norm": {"weight": flat["mlp_norm"]},
            "mlp": {"w_gateup": _fused_linear(flat, ("w_gate", "w_up"), fp8),
                    "w_down": _fused_linear(flat, ("w_down",), fp8)},
        },
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = {"kernel": flat["lm_head"]}
    return tree


def abstract_model(cfg: ModelConfig, dtype, fp8: bool = False, unroll_layers: bool = False
                   ) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                    fp8=fp8, unroll_layers=unroll_layers)))


def build_model(cfg: ModelConfig, flat: Mapping[str, object], dtype=jnp.float32,
                fp8: bool = False, unroll_layers: bool = False
                ) -> tuple[nnx.GraphDef, nnx.State]:
    """The decoder's (graphdef, state) holding `flat`'s weights in `dtype` (linears in FP8
    when fp8). The state is what the jitted step takes as its params argument."""
    graphdef, abstract = abstract_model(cfg, dtype, fp8, unroll_layers)
    tree = fused_tree(cfg, flat, fp8)
    want = nnx.to_pure_dict(abstract)

    def place(path, spec, value):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if tuple(value.shape) != tuple(spec.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(value.shape)}, the config "
                                 f"({cfg.name}) needs {tuple(spec.shape)}")
        return jnp.asarray(value, spec.dtype)

    try:
        values = jax.tree_util.tree_map_with_path(place, want, tree)
    except ValueError as e:  # tree structure mismatch
        raise ModelLoadError(f"checkpoint does not match the model structure: {e}") from None
    nnx.replace_by_pure_dict(abstract, values)
    return graphdef, abstract


def random_model(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0):
    """A randomly initialised decoder (the tiny test twin)."""
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype))
