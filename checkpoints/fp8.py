"""FP8 (e4m3) weight quantization for linear layers, and its orbax storage.

A linear weight w [..., in, out] (y = x @ w) becomes
    w_q   float8_e4m3fn [..., out, in]   K-major: each output channel's weights contiguous,
                                         the layout pallas_kernels/fp8_matmul.py streams and
                                         cuBLASLt's FP8 GEMM takes without a transpose
    scale float32       [..., out]       per output channel:
                                         w[..., k, n] ~= w_q[..., n, k] * scale[..., n]
One scale per output channel is applied once per output element, in the matmul's epilogue.
scale = max|w[:, n]| / 448 maps each channel's largest weight onto e4m3's largest finite value,
so nothing saturates and e4m3's 3 mantissa bits give at most 2^-4 relative rounding error per
weight (below 2^-6 * scale, the subnormal range, at most 2^-10 * scale absolute).

Embeddings and norms stay bf16. The LM head is quantized only when asked (`lm_head=True`):
it is ~6% of Llama-3-8B's bytes and the logits are where quantization error is most visible.
On SmolLM2 an FP8 head gives 86.8-88.9% top-1 agreement with bf16, below the 95% bar FP8
must meet (docs/performance.md), so the model has no FP8 head path. Its head can be int8
instead (quantize_int8_linear: codes [V, E], max/127 per vocab row; the
model's `int8_head`), rounded to nearest or, calibrated, by checkpoints/calibrate.py.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax.numpy as jnp
import numpy as np

from checkpoints.params import FP8_LINEARS, SCALE_SUFFIX

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
LINEAR_NAMES = FP8_LINEARS


def channel_scales(w):
    """w [..., in, out] float -> scale f32 [..., out]: max|w[..., :, n]| / 448 (1 for an
    all-zero channel, where any scale is exact)."""
    if w.ndim < 2:
        raise ValueError(f"FP8 quantization: w must be [..., in, out], got shape {w.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"FP8 quantization: w must be a float array, got {w.dtype}")
    amax = jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)), axis=-2)       # [..., out]
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def quantize_linear(w):
    """w [..., in, out] float -> (w_q float8_e4m3fn [..., out, in], scale f32 [..., out])."""
    scale = channel_scales(w)
    wt = jnp.swapaxes(jnp.asarray(w, jnp.float32), -1, -2)             # [..., out, in]
    # clip: amax / (amax / 448) can round a hair above 448, which e4m3fn would turn into NaN.
    w_q = jnp.clip(wt / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return w_q, scale


INT8_MAX = 127.0


def int8_channel_scales(w):
    """w [..., in, out] float -> scale f32 [..., out]: max|w[..., :, n]| / 127 (1 for an
    all-zero channel)."""
    amax = jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)), axis=-2)
    return jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)


def quantize_int8_linear(w):
    """w [..., in, out] float -> (codes int8 [..., out, in], scale f32 [..., out]), rounded
    to nearest: w[..., k, n] ~= codes[..., n, k] * scale[..., n]."""
    scale = int8_channel_scales(w)
    wt = jnp.swapaxes(jnp.asarray(w, jnp.float32), -1, -2)
    codes = jnp.clip(jnp.round(wt / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return codes, scale


def dequantize_linear(w_q, scale):
    """(w_q [..., out, in], scale [..., out]) -> w [..., in, out] float32."""
    w = w_q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)
    return jnp.swapaxes(w, -1, -2)


def quantize_params(flat: Mapping[str, np.ndarray], names: Iterable[str] = LINEAR_NAMES, *,
                    lm_head: bool = False, quantize=None) -> dict[str, np.ndarray]:
    """Quantize the linear weights of a canonical flat parameter dict.

    Each key in `names` (plus "lm_head", when lm_head=True and the model has one) is replaced by its
    w_q ([L, out, in] for the stacked [L, in, out] layer weights, [V, E] for lm_head [E, V])
    and gains a companion key name + "_scale" (f32 [L, out] / [V]). Every other key passes
    through unchanged. Values come back as numpy arrays (w_q with ml_dtypes' float8_e4m3fn).
    quantize(name, layer, w [in, out]) -> (w_q, scale) rounds one layer's weight (default:
    quantize_linear, round to nearest; checkpoints/calibrate.py passes its calibrated one).
    """
    wanted = set(names) | ({"lm_head"} if lm_head else set())
    missing = sorted(n for n in set(names) if n not in flat)
    if missing:
        raise KeyError(f"quantize_params: no weight named {missing} in the parameter dict "
                       f"(keys: {sorted(flat)})")
    out: dict[str, np.ndarray] = {}
    for key, value in flat.items():
        if key not in wanted:
            out[key] = value
            continue
        if key + SCALE_SUFFIX in flat:
            raise ValueError(f"quantize_params: {key!r} already has a {key + SCALE_SUFFIX!r}; "
                             "is the dict quantized already?")
        # One layer at a time: a whole stacked 8B weight in f32 would need ~8 GB of scratch.
        layers = [value] if value.ndim == 2 else list(value)
        pairs = [quantize_linear(jnp.asarray(w)) if quantize is None else quantize(key, i, w)
                 for i, w in enumerate(layers)]
        w_q, scale = (np.stack([np.asarray(p[i]) for p in pairs]) for i in (0, 1))
        out[key], out[key + SCALE_SUFFIX] = (w_q[0], scale[0]) if value.ndim == 2 else (w_q, scale)
    return out


def save_params(path, params: Mapping[str, np.ndarray]) -> None:
    """Write a (quantized) flat parameter dict with orbax; fp8 arrays keep their dtype."""
    import orbax.checkpoint as ocp
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, dict(params))
    ckpt.wait_until_finished()


def restore_params(path) -> dict:
    """Read back what save_params wrote (arrays as saved: numpy stays numpy, jax stays jax)."""
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer().restore(path)
