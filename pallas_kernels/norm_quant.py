"""RMSNorm fused with the per-token e4m3 quantization of its output, optionally after the
residual add of an FP8 GEMM's unscaled product: the FP8 decoder layer's glue in one pass.

On the FP8 tensor-core route (pallas_kernels/fp8_matmul.py, M > DEQUANT_MAX_M) a decoder
layer's inputs to QKV and to the MLP are

    x  = x + bf16(y * y_row_scale * y_col_scale)    # the O projection's product (MLP side)
    n  = bf16(rmsnorm(x) * w)
    n_q, n_scale = quantize_rows(n)                  # per token, for the next FP8 GEMM

which XLA runs as three kernels per use: the residual add with the product's scales, a
fusion for the rows' scales (RMSNorm and amax) and one for the cast (RMSNorm again).
`norm_quant` does each use in one kernel: a program owns BM rows, holds their E values in
registers (static chunks of BF columns), writes x (with the add) and the e4m3 codes and
scales; nothing else goes to memory.

`quant_rows` is the same kernel without the norm: a row's own per-token e4m3 codes (the
attention output before the O projection).

Numerics: the XLA route's, rounding for rounding (the product's scaled value and the sum to
bf16, the normalized row to bf16 before its amax), so codes match it up to the last bit of
rsqrt and division on the GPU. Shapes the kernel does not take (E without a power-of-two
chunk >= 16, or over max_live) run the reference.
Backend: Pallas Triton, like the other kernels here (pallas_kernels/paged_attention.py says
why).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_params
from pallas_kernels.fp8_matmul import (FP8_DTYPE, amax_scale, e4m3_codes, quantize_rows,
                                       tc_scaled)
from pallas_kernels.swiglu_quant import chunk

NUM_WARPS = 8   # faster than 4 in the 8B decode step (H200)
LIVE_PER_THREAD = 64     # values of x one thread holds (E * BM / threads)


def supported(e: int) -> bool:
    return chunk(e) is not None and e <= LIVE_PER_THREAD * 32 * NUM_WARPS


def norm_quant_reference(x, w, eps: float, delta=None):
    """Plain jnp, the XLA route's math: x [M, E], w [E]; delta = (y [M, E] unscaled product,
    y_row_scale [M, 1] f32, y_col_scale [E] f32) added to x first. Returns (x after the add, or
    None without delta; n_q e4m3 [M, E]; n_scale f32 [M, 1])."""
    x_new = None
    if delta is not None:
        x = x_new = x + tc_scaled(*delta, x.dtype)
    xf = x.astype(jnp.float32)
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    n_q, n_scale = quantize_rows((n * w.astype(jnp.float32)).astype(x.dtype))
    return x_new, n_q, n_scale


def _kernel(*refs, e: int, bf: int, bm: int, eps: float, add: bool, norm: bool = True):
    if add:
        x_ref, y_ref, rs_ref, cs_ref, w_ref, xo_ref, q_ref, s_ref = refs
    elif norm:
        x_ref, w_ref, q_ref, s_ref = refs
    else:                                  # quant_rows: the rows' own e4m3 codes
        x_ref, q_ref, s_ref = refs
    rows = pl.ds(pl.program_id(0) * bm, bm)
    if add:
        rs = rs_ref[rows]                                                 # [BM] f32
    xs, ss = [], jnp.zeros((bm,), jnp.float32)
    for c in range(e // bf):                       # static: the rows stay in registers
        cols = pl.ds(c * bf, bf)
        x = x_ref[rows, cols]
        if add:
            h = (y_ref[rows, cols].astype(jnp.float32) * rs[:, None]
                 * cs_ref[cols][None, :]).astype(x.dtype)
            x = (x.astype(jnp.float32) + h.astype(jnp.float32)).astype(x.dtype)
            xo_ref[rows, cols] = x
        xf = x.astype(jnp.float32)
        if norm:
            ss = ss + jnp.sum(xf * xf, axis=1)
        xs.append(xf)
    inv = jax.lax.rsqrt(ss / e + eps) if norm else None
    ns, amax = [], jnp.zeros((bm,), jnp.float32)
    for c, xf in enumerate(xs):
        n = xf if not norm else (
            xf * inv[:, None] * w_ref[pl.ds(c * bf, bf)].astype(jnp.float32)[None, :]
        ).astype(x_ref.dtype).astype(jnp.float32)
        amax = jnp.maximum(amax, jnp.max(jnp.maximum(n, -n), axis=1))
        ns.append(n)
    scale = amax_scale(amax)
    for c, n in enumerate(ns):
        q_ref[rows, pl.ds(c * bf, bf)] = e4m3_codes(n, scale[:, None], q_ref.dtype)
    s_ref[rows] = scale


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def norm_quant(x, w, delta=None, *, eps: float, interpret: bool = False):
    """norm_quant_reference in one kernel (module doc): x [M, E] bf16, w [E], delta None or
    (y [M, E], y_row_scale [M, 1], y_col_scale [E]). Returns (x after the add or None,
    n_q e4m3 [M, E], n_scale f32 [M, 1])."""
    m, e = x.shape
    if w.shape != (e,) or (delta is not None and (
            delta[0].shape != (m, e) or delta[1].shape != (m, 1) or delta[2].shape != (e,))):
        raise ValueError(f"norm_quant: want x [M, E], w [E], delta ([M, E], [M, 1], [E]); got "
                         f"{x.shape}, {w.shape}, "
                         f"{None if delta is None else [d.shape for d in delta]}")
    if not supported(e):
        return norm_quant_reference(x, w, eps, delta)
    add = delta is not None
    ins = [x]
    if add:
        y, rs, cs = delta
        ins += [y, rs.reshape(m).astype(jnp.float32), cs.astype(jnp.float32)]
    ins.append(w)
    outs = ([jax.ShapeDtypeStruct((m, e), x.dtype)] if add else []) + [
        jax.ShapeDtypeStruct((m, e), FP8_DTYPE), jax.ShapeDtypeStruct((m,), jnp.float32)]
    params = triton_params(interpret, NUM_WARPS, num_stages=1)
    res = pl.pallas_call(
        functools.partial(_kernel, e=e, bf=chunk(e), bm=1, eps=float(eps), add=add),
        out_shape=outs, grid=(m,), interpret=interpret, name="norm_quant", **params,
    )(*ins)
    x_new = res[0] if add else None
    return x_new, res[-2], res[-1][:, None]


@functools.partial(jax.jit, static_argnames=("interpret",))
def quant_rows(x, *, interpret: bool = False):
    """fp8_matmul.quantize_rows in one kernel (the same amax_scale and e4m3_codes): x [M, E]
    -> (e4m3 [M, E], f32 scales [M, 1]). The fused FP8 layer quantizes the attention output
    with it before the O projection, in place of XLA's three kernels (an amax reduce, a
    select for zero rows' scales and the convert)."""
    m, e = x.shape
    if not supported(e):
        return quantize_rows(x)
    q, scale = pl.pallas_call(
        functools.partial(_kernel, e=e, bf=chunk(e), bm=1, eps=0.0, add=False, norm=False),
        out_shape=[jax.ShapeDtypeStruct((m, e), FP8_DTYPE),
                   jax.ShapeDtypeStruct((m,), jnp.float32)],
        grid=(m,), interpret=interpret, name="quant_rows",
        **triton_params(interpret, NUM_WARPS, num_stages=1))(x)
    return q, scale[:, None]
