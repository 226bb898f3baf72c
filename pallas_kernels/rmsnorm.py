"""The residual add and the RMSNorm after it in one kernel: the decoder layer's glue on the
bf16 route (and the FP8 route's fused-dequant decode steps).

model.DecoderLayer runs, twice per layer,

    x = x + delta                       # the attention's (MLP's) output joins the residual
    n = bf16(rmsnorm(x) * w)            # the next projection's input

which XLA ran as three kernels per use in the 8B decode step at batch 1 (H200 profile,
eleventh session: the add, the rows' sum of squares, the normalization; ~1.5 us each, the
work itself being a few KB): six of the step's ~18 kernels per layer. `add_rmsnorm` does a
use in one kernel: a program owns one row, holds its E values in registers (static chunks of
BF columns), writes x after the add and n; nothing else goes to memory.

Numerics: the XLA route's rounding (the sum to x's dtype before the norm, n rounded once);
the sum of squares is added in a different order, so n may differ in its last bit.
Shapes the kernel does not take (E without a power-of-two chunk >= 16, or a row over
LIVE_PER_THREAD values per thread) run the reference.
Backend: Pallas Triton, like the other kernels here (pallas_kernels/paged_attention.py says
why).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_params
from pallas_kernels.swiglu_quant import chunk

NUM_WARPS = 4
LIVE_PER_THREAD = 64     # values of x one thread holds (E / threads)


def supported(e: int) -> bool:
    return chunk(e) is not None and e <= LIVE_PER_THREAD * 32 * NUM_WARPS


def add_rmsnorm_reference(x, w, delta=None, *, eps: float):
    """Plain jnp (model.RMSNorm's math): x [M, E], w [E], delta None, [M, E] added to x
    first, or split-K partials [S, M, E] (f32) of it, summed and rounded to x's dtype before
    the add. Returns (x after the add, n [M, E] in x's dtype)."""
    if delta is not None:
        x = x + (delta if delta.ndim == 2 else jnp.sum(delta, axis=0).astype(x.dtype))
    xf = x.astype(jnp.float32)
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x, (n * w.astype(jnp.float32)).astype(x.dtype)


def _kernel(*refs, e: int, bf: int, eps: float, add: bool, parts: int):
    if add:
        x_ref, d_ref, w_ref, xo_ref, n_ref = refs
    else:
        x_ref, w_ref, n_ref = refs
    row = pl.ds(pl.program_id(0), 1)
    # the weight is read before the reduction, so its load is not a second round trip after it
    ws = [w_ref[pl.ds(c * bf, bf)].astype(jnp.float32)[None, :] for c in range(e // bf)]
    xs, ss = [], jnp.zeros((1,), jnp.float32)
    for c in range(e // bf):                       # static: the row stays in registers
        cols = pl.ds(c * bf, bf)
        x = x_ref[row, cols]                                              # [1, BF]
        if add:
            if parts:     # split-K partials [S * M, E]: summed, rounded as the linear's output
                m = pl.num_programs(0)
                d = d_ref[row, cols]
                for p in range(1, parts):
                    d = d + d_ref[pl.ds(p * m + pl.program_id(0), 1), cols]
                d = d.astype(x.dtype)
            else:
                d = d_ref[row, cols]
            x = (x.astype(jnp.float32) + d.astype(jnp.float32)).astype(x.dtype)
            xo_ref[row, cols] = x
        xf = x.astype(jnp.float32)
        ss = ss + jnp.sum(xf * xf, axis=1)
        xs.append(xf)
    inv = jax.lax.rsqrt(ss / e + eps)[:, None]
    for c, (xf, w) in enumerate(zip(xs, ws)):
        n_ref[row, pl.ds(c * bf, bf)] = (xf * inv * w).astype(n_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rmsnorm(x, w, delta=None, *, eps: float, interpret: bool = False):
    """add_rmsnorm_reference in one kernel (module doc): x [M, E], w [E], delta None,
    [M, E] of x's dtype, or f32 split-K partials [S, M, E] of it (ops.linear_partials).
    Returns (x after the add (x itself without delta), n [M, E])."""
    m, e = x.shape
    parts = delta.shape[0] if delta is not None and delta.ndim == 3 else 0
    if w.shape != (e,) or (delta is not None and (
            delta.shape[-2:] != x.shape or delta.ndim not in (2, 3)
            or delta.dtype != (jnp.float32 if parts else x.dtype))):
        raise ValueError(f"add_rmsnorm: want x [M, E], w [E], delta [M, E] of x's dtype or "
                         f"[S, M, E] f32; got {x.shape}, {w.shape}, "
                         f"{None if delta is None else (delta.shape, delta.dtype)}")
    if not supported(e):
        return add_rmsnorm_reference(x, w, delta, eps=eps)
    add = delta is not None
    ins = [x, delta.reshape(-1, e) if parts else delta, w] if add else [x, w]
    row = jax.ShapeDtypeStruct((m, e), x.dtype)
    res = pl.pallas_call(
        functools.partial(_kernel, e=e, bf=chunk(e), eps=float(eps), add=add, parts=parts),
        out_shape=[row, row] if add else [row], grid=(m,), interpret=interpret,
        name="add_rmsnorm", **triton_params(interpret, NUM_WARPS, num_stages=1),
    )(*ins)
    return (res[0], res[1]) if add else (x, res[0])
