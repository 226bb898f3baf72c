"""From a loader's canonical flat dict of weights to the NNX decoder's state.

The canonical names and shapes are checkpoints.params.param_shapes (what every loader
returns: stacked per layer, linears [in, out], or FP8 [out, in] + scales; arrays, or
checkpoints.lazy tensors read slice by slice where the devices need them). The model fuses
q/k/v and gate/up into single matmuls; that happens here, once, at load — shard-major when
tensor parallel (see _shard_major), so each device's slice of a fused matmul is its own.
"""
from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.fp8 import dequantize_linear, quantize_int8_linear, quantize_linear
from checkpoints.lazy import Lazy, ShardMajor, device_array
from checkpoints.params import SCALE_SUFFIX, check_params, has_int8_head
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ModelLoadError
from jaxinfer.model import Decoder, rope_inv_freq
from jaxinfer.sharding import TPLayout, state_specs


def _shard_major(xp, arrs, axis: int, shards: int):
    """Concatenate `arrs` along `axis` as [shards, (slice s of each input)]: shard s of the
    result (split over `shards`) holds slice s of every input, so a column-parallel fused
    matmul computes its own heads' q, k and v locally. shards=1: a plain concatenation.
    The reshapes keep inputs sharded the same way local (no gather)."""
    axis = axis % arrs[0].ndim
    split = [xp.reshape(a, a.shape[:axis] + (shards, -1) + a.shape[axis + 1:]) for a in arrs]
    out = xp.concatenate(split, axis=axis + 1)
    return xp.reshape(out, out.shape[:axis] + (-1,) + out.shape[axis + 2:])


# Device arrays are fused in one program: no eager temporaries beside inputs and output.
_shard_major_device = jax.jit(functools.partial(_shard_major, jnp),
                              static_argnames=("axis", "shards"))


def _cat(flat, names, axis=-1, shards=1):
    """Pop `names` from `flat` and fuse them (see _shard_major)."""
    arrs = [flat.pop(n) for n in names]
    if len(arrs) == 1:
        return arrs[0]
    if all(isinstance(a, Lazy) for a in arrs):      # read later, slice by slice
        return ShardMajor(arrs, axis, shards)
    if all(isinstance(a, np.ndarray) for a in arrs):
        return _shard_major(np, arrs, axis, shards)
    return _shard_major_device(arrs, axis=axis, shards=shards)


def _fused_linear(flat, names, fp8: bool, shards: int = 1) -> dict:
    """Fuse `names` along the output axis (shard-major over `shards`, see _cat); FP8
    ([L, out, in] + name_scale [L, out], from checkpoints.fp8) stays FP8, float weights are
    quantized here when fp8 is asked for."""
    if names[0] + SCALE_SUFFIX in flat:
        if not fp8:
            raise ModelLoadError("this checkpoint holds FP8 weights: load it with weights='fp8'")
        return {"kernel": _cat(flat, names, axis=-2, shards=shards),
                "scale": _cat(flat, [n + SCALE_SUFFIX for n in names], shards=shards)}
    kernel = _cat(flat, names, shards=shards)
    if not fp8:
        return {"kernel": kernel}
    pairs = [quantize_linear(jnp.asarray(w)) for w in kernel]   # per layer: bounded scratch
    return {"kernel": jnp.stack([p[0] for p in pairs]), "scale": jnp.stack([p[1] for p in pairs])}


def _int8_head(flat: dict) -> dict:
    """The int8 LM head's state: a checkpoint's own (lm_head codes [V, E] + lm_head_scale),
    or its float head (lm_head [E, V], else the tied embedding's transpose) rounded to
    nearest here (checkpoints.fp8.quantize_int8_linear)."""
    if has_int8_head(flat):
        return {"kernel": flat.pop("lm_head"), "scale": flat.pop("lm_head" + SCALE_SUFFIX)}
    w = flat.pop("lm_head") if "lm_head" in flat else jnp.asarray(flat["embed"]).T
    codes, scale = quantize_int8_linear(jnp.asarray(w))
    return {"kernel": codes, "scale": scale}


@functools.partial(jax.jit, static_argnums=2)
def _dequantized_head(codes, scale, dtype):
    """codes [V, E] int8, scale [V] -> codes * scale [V, E] in dtype: dequantize_linear's
    product, jitted so that XLA fuses it with the cast (no f32 copy of the head)."""
    return jnp.swapaxes(dequantize_linear(codes, scale), -1, -2).astype(dtype)


def fused_tree(cfg: ModelConfig, flat: dict, fp8: bool = False,
               layout: TPLayout = TPLayout(), int8_head: bool = False,
               dense_head_above: int | None = None) -> dict:
    """Canonical flat dict -> the nested dict of the Decoder's state (fused projections,
    laid out shard-major for `layout`'s attention and MLP shards). Empties `flat` as it
    goes, so a weight the caller no longer holds is freed once fused. int8_head: the LM
    head as int8 (_int8_head); with dense_head_above also its codes dequantized to the
    embedding's dtype (lm_head_dense [V, E]: model.Decoder.logits). A checkpoint's int8 head
    loaded with int8_head=False: the tied embedding serves as the head (the int8 one is
    dropped); untied, the float head is gone, which is an error."""
    check_params(cfg, flat, "checkpoint")
    if has_int8_head(flat) and not int8_head:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError("this checkpoint holds an int8 LM head and no float one: "
                                 "load it with lm_head='int8'")
        del flat["lm_head"], flat["lm_head" + SCALE_SUFFIX]
    head = _int8_head(flat) if int8_head else None     # before the embedding leaves flat
    wqkv = _fused_linear(flat, ("wq", "wk", "wv"), fp8, layout.attn)
    if cfg.qkv_bias:
        wqkv["bias"] = _cat(flat, ("bq", "bk", "bv"), shards=layout.attn)
    tree = {
        "embed": flat.pop("embed"),
        "final_norm": {"weight": flat.pop("final_norm")},
        "inv_freq": rope_inv_freq(cfg),
        "layers": {
            "attn_norm": {"weight": flat.pop("attn_norm")},
            "attn": {"wqkv": wqkv, "wo": _fused_linear(flat, ("wo",), fp8)},
            "mlp_norm": {"weight": flat.pop("mlp_norm")},
            "mlp": {"w_gateup": _fused_linear(flat, ("w_gate", "w_up"), fp8, layout.mlp),
                    "w_down": _fused_linear(flat, ("w_down",), fp8)},
        },
    }
    if head is not None:
        tree["lm_head"] = head
        if dense_head_above is not None:
            tree["lm_head_dense"] = _dequantized_head(head["kernel"], head["scale"],
                                                      tree["embed"].dtype)
    elif not cfg.tie_word_embeddings:
        tree["lm_head"] = {"kernel": flat.pop("lm_head")}
    return tree


def per_layer(stacked: dict, num_layers: int) -> dict:
    """{name: [L, ...]} -> {i: {name: [...]}}: one buffer per layer (unrolled models).
    Empties `stacked` as it goes, so each stacked array is freed once split: the peak is
    one array's worth above the weights."""
    out: dict = {i: {} for i in range(num_layers)}

    def move(src: dict, dsts: list[dict]):
        for key in list(src):
            value = src.pop(key)
            if isinstance(value, dict):
                move(value, [d.setdefault(key, {}) for d in dsts])
            else:
                for i, d in enumerate(dsts):
                    d[key] = value[i]

    move(stacked, [out[i] for i in range(num_layers)])
    return out


def abstract_model(cfg: ModelConfig, dtype, fp8: bool = False, unroll_layers: bool = False,
                   layout: TPLayout = TPLayout(), int8_head: bool = False,
                   dense_head_above: int | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: Decoder(
        cfg, rngs=nnx.Rngs(0), dtype=dtype, fp8=fp8, unroll_layers=unroll_layers,
        layout=layout, int8_head=int8_head, dense_head_above=dense_head_above)))


def build_model(cfg: ModelConfig, flat: Mapping[str, object], dtype=jnp.float32,
                fp8: bool = False, unroll_layers: bool = False,
                layout: TPLayout = TPLayout(), consume: bool = False, int8_head: bool = False,
                dense_head_above: int | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The decoder's (graphdef, state) holding `flat`'s weights in `dtype` (linears in FP8
    when fp8). The state is what the jitted step takes as its params argument.
    consume: `flat` is a dict handed over and emptied while fusing — peak memory is then the
    weights plus one fused group, not twice the weights (a 70B model on two GPUs).
    With a tensor-parallel `layout` every weight is placed by its sharding.state_specs spec:
    host (numpy) weights go shard by shard to their devices, never whole onto one, and
    lazy ones (checkpoints.lazy) are read only where this process's devices need them."""
    graphdef, abstract = abstract_model(cfg, dtype, fp8, unroll_layers, layout, int8_head,
                                        dense_head_above)
    tree = fused_tree(cfg, flat if consume and isinstance(flat, dict) else dict(flat), fp8,
                      layout, int8_head, dense_head_above)
    if unroll_layers:
        tree["layers"] = per_layer(tree["layers"], cfg.num_layers)
    want = nnx.to_pure_dict(abstract)
    specs = state_specs(layout, want)

    def place(path, spec, value, pspec):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if tuple(value.shape) != tuple(spec.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(value.shape)}, the config "
                                 f"({cfg.name}) needs {tuple(spec.shape)}")
        if isinstance(value, Lazy):
            if layout.mesh is not None:
                return device_array(value, spec.shape, spec.dtype, layout.named(pspec))
            value = np.asarray(value)
        if layout.mesh is None:
            return jnp.asarray(value, spec.dtype)
        host = isinstance(value, np.ndarray)
        value = np.asarray(value, spec.dtype) if host else value.astype(spec.dtype)
        return jax.device_put(value, layout.named(pspec))

    try:
        values = jax.tree_util.tree_map_with_path(place, want, tree, specs)
    except ValueError as e:  # tree structure mismatch
        raise ModelLoadError(f"checkpoint does not match the model structure: {e}") from None
    nnx.replace_by_pure_dict(abstract, values)
    return graphdef, abstract
