"""Calibrated FP8 rounding (GPTQ-style): the same e4m3 format and per-output-channel scales as
checkpoints/fp8.py, but each weight is rounded knowing the error its input channel will cause,
and the not-yet-rounded weights of the same output channel absorb it.

For a linear y = x @ w (w [in, out]) fed inputs X [n, in], rounding w to q costs
||X (w - q)||^2 = sum over output channels of (w - q)^T G (w - q), G = X^T X. Round-to-nearest
(RTN, quantize_linear) ignores G. Here the input rows of w are rounded one at a time (in order
of decreasing G diagonal: the most active inputs first), and after each row the rounding error
is propagated to the rows still to be rounded through the inverse of G (its Cholesky factor),
so correlated inputs compensate each other (Frantar et al., "GPTQ", 2022; applied here to a
float format with fixed per-channel scales: max|w[:, n]| / 448, as RTN).

G comes from a float32 forward of the model itself over calibration text: documentation
strings of a fixed list of standard-library modules (text that ships with Python, and NOT
pydoc_data.topics, on which tests/test_fp8_quality.py judges the result). On SmolLM2 it lifts
top-1 agreement with bf16 from 92.7% (RTN) to 96.0% (docs/performance.md). Defaults: 32
windows of 512 tokens (better than 16 or 24, for a longer conversion) and damping 0.001.
Measured worse and not adopted: damping 0.01 and 0.1, each layer calibrated on the previous
layers' quantized outputs ("sequential"), rows in their original order instead of by
decreasing activity.

Cost: a float32 forward over the calibration tokens plus, per linear, an [in, in] inverse and
a row loop: ~1 minute for SmolLM2 on two CPU cores; far more for an 8B model on a CPU. It
is therefore a conversion step (`jaxinfer convert SRC DST --weights fp8 --calibrate`), not
something every FP8 load pays.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from checkpoints.fp8 import (FP8_DTYPE, FP8_MAX, INT8_MAX, LINEAR_NAMES, channel_scales,
                             int8_channel_scales, quantize_params)
from checkpoints.params import SCALE_SUFFIX
from jaxinfer.model import rope_inv_freq
from pallas_kernels.rope import apply_rope

# Modules whose documentation strings make the calibration text (all in every CPython 3.10+;
# the strings themselves change a little between Python versions, and so the rounding).
CALIBRATION_MODULES = (
    "collections", "itertools", "functools", "json", "argparse", "pathlib", "re", "typing",
    "dataclasses", "textwrap", "string", "datetime", "random", "statistics", "heapq", "bisect",
    "logging", "unittest", "subprocess", "shutil", "os", "fractions", "decimal", "csv", "enum",
    "contextlib", "abc", "threading", "queue", "socket")
# Which input each linear reads: its Gram matrix is shared by the linears of one input.
INPUT_OF = {"wq": "attn_in", "wk": "attn_in", "wv": "attn_in", "wo": "wo_in",
            "w_gate": "mlp_in", "w_up": "mlp_in", "w_down": "down_in"}
# The linears that read one input, rounded together (calibrated_quantize_params).
SHARED_INPUT = (("wq", "wk", "wv"), ("w_gate", "w_up"))
# Calibration windows of 512 tokens by default (the module doc says why 32).
DEFAULT_WINDOWS = 32


def calibration_text() -> str:
    """The documentation strings (> 200 characters, deduplicated, in a fixed order) of
    CALIBRATION_MODULES and their public members."""
    parts, seen = [], set()
    for name in CALIBRATION_MODULES:
        mod = importlib.import_module(name)
        docs = [inspect.cleandoc(mod.__doc__ or "")]
        with warnings.catch_warnings():   # e.g. typing.io's deprecation, on attribute access
            warnings.simplefilter("ignore", DeprecationWarning)
            docs += [inspect.getdoc(getattr(mod, m, None)) or "" for m in sorted(dir(mod))
                     if not m.startswith("_")]
        for d in docs:
            if len(d) > 200 and d not in seen:
                seen.add(d)
                parts.append(d)
    return "\n\n".join(parts)


def calibration_windows(tokenizer, num_windows: int = DEFAULT_WINDOWS,
                        window: int = 512) -> np.ndarray:
    """[num_windows, window] token ids of calibration_text()."""
    ids = tokenizer.encode(calibration_text())
    if len(ids) < num_windows * window:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than "
                         f"{num_windows} x {window}")
    return np.asarray(ids[:num_windows * window], np.int32).reshape(num_windows, window)


def _rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer_grams(cfg, p, x):
    """One decoder layer in float32 over x [T, E]: (next x, {input kind: X^T X})."""
    t = x.shape[0]
    h, kh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    a = _rms(x, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = a @ p["wq"], a @ p["wk"], a @ p["wv"]
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = apply_rope(q.reshape(t, h, d), cos, sin)
    k = jnp.repeat(apply_rope(k.reshape(t, kh, d), cos, sin), h // kh, axis=1)
    v = jnp.repeat(v.reshape(t, kh, d), h // kh, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None], s, -jnp.inf)
    o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), v).reshape(t, h * d)
    x = x + o @ p["wo"]
    m = _rms(x, p["mlp_norm"], cfg.rms_norm_eps)
    act = jax.nn.silu(m @ p["w_gate"]) * (m @ p["w_up"])
    x = x + act @ p["w_down"]
    hi = jax.lax.Precision.HIGHEST
    grams = {name: jnp.matmul(y.T, y, precision=hi) for name, y in
             (("attn_in", a), ("wo_in", o), ("mlp_in", m), ("down_in", act))}
    return x, grams


def input_grams(cfg, flat, windows, progress: bool = False) -> dict[str, np.ndarray]:
    """{input kind: [L, in, in] float64}: X^T X of each layer's linear inputs, summed over the
    windows (each a separate sequence), from a float32 forward of the unquantized weights;
    and "head_in" [E, E]: the LM head's (the final RMSNorm's output)."""
    from tqdm import tqdm

    layer_keys = ["attn_norm", "mlp_norm", *LINEAR_NAMES] + (
        ["bq", "bk", "bv"] if cfg.qkv_bias else [])
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))  # noqa: E731
    embed = np.asarray(flat["embed"], np.float32)
    xs = [f32(embed[w]) for w in windows]
    grams: dict[str, list] = {k: [] for k in ("attn_in", "wo_in", "mlp_in", "down_in")}
    for layer in tqdm(range(cfg.num_layers), desc="calibration forward", unit="layer",
                      disable=not progress):
        p = {k: f32(flat[k][layer]) for k in layer_keys}   # one layer at a time to the host
        total = None
        for i, x in enumerate(xs):
            xs[i], g = _layer_grams(cfg, p, x)
            total = g if total is None else {k: total[k] + g[k] for k in g}
        for k, g in total.items():
            grams[k].append(np.asarray(g, np.float64))
    out = {k: np.stack(v) for k, v in grams.items()}
    norm = f32(flat["final_norm"])
    hs = [np.asarray(_rms(x, norm, cfg.rms_norm_eps), np.float64) for x in xs]
    out["head_in"] = sum(h.T @ h for h in hs)
    return out


def _round_e4m3(x):
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _round_int8(x):
    return np.clip(np.round(x), -INT8_MAX, INT8_MAX)


def _lower_inverse(low):
    """inv(low) for a lower-triangular matrix, by halves: [[A, 0], [C, D]]^-1 =
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]] (numpy's own BLAS: scipy's triangular inverse brought
    a second BLAS thread pool, which slowed the whole row loop around it on two cores)."""
    n = low.shape[0]
    if n <= 128:
        return np.tril(np.linalg.inv(low))
    h = n // 2
    a, d = _lower_inverse(low[:h, :h]), _lower_inverse(low[h:, h:])
    out = np.zeros_like(low)
    out[:h, :h], out[h:, h:] = a, d
    out[h:, :h] = -(d @ low[h:, :h]) @ a
    return out


def _inverse_cholesky_upper(g):
    """Upper-triangular U with U^T U = inv(g), g symmetric positive definite, without forming
    inv(g): with J the reversal, J g J = L L^T (Cholesky), so g = R R^T for the upper
    R = J L J and U = inv(R) = J inv(L) J, a triangular inverse: ~2.5x faster than
    cholesky(inv(g)), whose general inverse took an eighth of the conversion."""
    low = np.linalg.cholesky(np.ascontiguousarray(g[::-1, ::-1]))
    return np.ascontiguousarray(_lower_inverse(low)[::-1, ::-1])


def gptq_linear(w, gram, *, damp: float = 0.001, block: int = 128, act_order: bool = True,
                inner: int = 16, fmt: str = "e4m3"):
    """w [in, out] float, gram [in, in] (X^T X of its inputs) -> (w_q float8_e4m3fn [out, in],
    scale f32 [out]), the format of checkpoints.fp8.quantize_linear, with the same scales.
    damp: added to G's diagonal as a fraction of its mean (keeps the inverse well posed);
    act_order: round the inputs with the largest G diagonal first. Rows are rounded one at a
    time; each row's error reaches the rows after it through rank-1 updates within `inner`
    rows, one product per inner group within `block` rows, and one per block beyond it: the
    same sums as updating every later row at once, grouped (float64; per-row updates of
    whole blocks would take most of the loop). fmt "int8": codes int8 [out, in] with max/127
    scales (the LM head's form)."""
    if fmt not in ("e4m3", "int8"):
        raise ValueError(f"gptq_linear: fmt must be 'e4m3' or 'int8', got {fmt!r}")
    w = np.asarray(w, np.float64)
    n = w.shape[0]
    if gram.shape != (n, n):
        raise ValueError(f"gptq_linear: gram {gram.shape} does not match w {w.shape}")
    rnd = _round_e4m3 if fmt == "e4m3" else _round_int8
    scales = channel_scales if fmt == "e4m3" else int8_channel_scales
    scale32 = np.asarray(scales(jnp.asarray(w, jnp.float32)))            # RTN's own scales
    scale = scale32.astype(np.float64)
    g = np.array(gram, np.float64)
    dead = np.diag(g) == 0          # inputs never seen: nothing to compensate with
    g[dead, dead] = 1.0
    order = np.argsort(-np.diag(g), kind="stable") if act_order else np.arange(n)
    w, g = w[order].copy(), g[np.ix_(order, order)]
    g[np.diag_indices(n)] += damp * np.mean(np.diag(g))
    u = _inverse_cholesky_upper(g)               # upper: G^-1 = U^T U
    q8 = np.zeros_like(w)
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        wb, err = w[b0:b1].copy(), np.zeros((b1 - b0, w.shape[1]))
        for g0 in range(0, b1 - b0, inner):
            g1 = min(g0 + inner, b1 - b0)
            for i in range(g0, g1):
                q8[b0 + i] = rnd(wb[i] / scale)
                err[i] = (wb[i] - q8[b0 + i] * scale) / u[b0 + i, b0 + i]
                wb[i + 1:g1] -= np.outer(u[b0 + i, b0 + i + 1:b0 + g1], err[i])
            wb[g1:] -= u[b0 + g0:b0 + g1, b0 + g1:b1].T @ err[g0:g1]
        w[b1:] -= u[b0:b1, b1:].T @ err
    q8 = q8[np.argsort(order)]
    return q8.T.astype(FP8_DTYPE if fmt == "e4m3" else np.int8), scale32


def calibrated_quantize_params(cfg, flat, tokenizer, *, num_windows: int = DEFAULT_WINDOWS,
                               window: int = 512, progress: bool = False,
                               int8_head: bool = False) -> dict:
    """checkpoints.fp8.quantize_params' output (every decoder linear as w_q [L, out, in] +
    its _scale [L, out]; other keys unchanged), rounded by gptq_linear on Gram matrices from
    calibration_windows(). The linears of one input (SHARED_INPUT) are rounded as one matrix,
    their columns side by side: each output column is rounded on its own (the same sums), so
    this gives what one call per linear would, with one factorization and one row loop for
    the group. int8_head: the LM head (lm_head, else the tied embedding) rounded by
    gptq_linear to int8 as well (lm_head codes [V, E] + lm_head_scale [V])."""
    from tqdm import tqdm

    if tokenizer is None:
        raise ValueError("calibrated FP8 needs the model's tokenizer to read its calibration "
                         "text (synthetic-weight shapes have none): quantize without "
                         "calibration instead")
    grams = input_grams(cfg, flat, calibration_windows(tokenizer, num_windows, window),
                        progress)
    group_of = {name: group for group in SHARED_INPUT for name in group}
    done: dict[tuple[str, int], tuple] = {}     # rounded, not yet handed to quantize_params
    with tqdm(total=len(LINEAR_NAMES) * cfg.num_layers, desc="calibrated FP8 rounding",
              unit="matrix", disable=not progress) as bar:
        def calibrated(name, layer, w):
            if (name, layer) not in done:
                group = group_of.get(name, (name,))
                ws = [np.asarray(w if n == name else flat[n][layer], np.float32)
                      for n in group]
                w_q, scale = gptq_linear(np.concatenate(ws, axis=1),
                                         grams[INPUT_OF[name]][layer])
                ends = np.cumsum([x.shape[1] for x in ws])
                for n, lo, hi in zip(group, ends - [x.shape[1] for x in ws], ends):
                    done[n, layer] = (w_q[lo:hi], scale[lo:hi])
            bar.update(1)
            return done.pop((name, layer))
        out = quantize_params(flat, quantize=calibrated)
    if int8_head:
        w = flat["lm_head"] if "lm_head" in flat else np.asarray(flat["embed"]).T   # [E, V]
        out["lm_head"], out["lm_head" + SCALE_SUFFIX] = gptq_linear(
            np.asarray(w, np.float32), grams["head_in"], fmt="int8")
    return out
