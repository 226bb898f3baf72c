"""The residual add and the RMSNorm after it in one kernel: the decoder layer's glue on the
bf16 route (and the FP8 route's fused-dequant decode steps).

model.DecoderLayer runs, twice per layer,

    x = x + delta                       # the attention's (MLP's) output joins the residual
    n = bf16(rmsnorm(x) * w)            # the next projection's input

which XLA ran as two kernels per use in the 8B decode step at batch 1 (H200 profile, eleventh
session: an add fusion and another fusion at 63 calls per step each, read by their names
and counts as the add and the norm; ~1.8 us each, the work itself being a few KB).
`add_rmsnorm` does a use in one kernel: a program owns one row, holds its E values in
registers (static chunks of BF columns), writes x after the add and n; nothing else goes to
memory. Measured there (twelfth session, bench/README.md): 2.6 us per call, and the step's
time did not move (ops.FUSED_GLUE). The fourteenth session found XLA's own fusion of the
add and the norm faster (alone, chained: 0.7-0.8 us per [8, 4096..5120] call against the
kernel's 1.8-2.7 us at 2-16 warps; the decode steps' A/B is at ops.PALLAS_ADD_NORM), so
the model no longer calls this kernel by default: ops.PALLAS_ADD_NORM turns it back on.

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
    """Plain jnp (model.RMSNorm's math): x [M, E], w [E], delta None or [M, E] added to x
    first. Returns (x after the add, n [M, E] in x's dtype)."""
    if delta is not None:
        x = x + delta
    xf = x.astype(jnp.float32)
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x, (n * w.astype(jnp.float32)).astype(x.dtype)


def _kernel(*refs, e: int, bf: int, eps: float, add: bool):
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
            x = (x.astype(jnp.float32) + d_ref[row, cols].astype(jnp.float32)).astype(x.dtype)
            xo_ref[row, cols] = x
        xf = x.astype(jnp.float32)
        ss = ss + jnp.sum(xf * xf, axis=1)
        xs.append(xf)
    inv = jax.lax.rsqrt(ss / e + eps)[:, None]
    for c, (xf, w) in enumerate(zip(xs, ws)):
        n_ref[row, pl.ds(c * bf, bf)] = (xf * inv * w).astype(n_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rmsnorm(x, w, delta=None, *, eps: float, interpret: bool = False):
    """add_rmsnorm_reference in one kernel (module doc): x [M, E], w [E], delta None or
    [M, E] of x's dtype. Returns (x after the add (x itself without delta), n [M, E])."""
    m, e = x.shape
    if w.shape != (e,) or (delta is not None and (delta.shape != x.shape
                                                  or delta.dtype != x.dtype)):
        raise ValueError(f"add_rmsnorm: want x [M, E], w [E], delta [M, E] of x's dtype; got "
                         f"{x.shape}, {w.shape}, "
                         f"{None if delta is None else (delta.shape, delta.dtype)}")
    if not supported(e):
        return add_rmsnorm_reference(x, w, delta, eps=eps)
    add = delta is not None
    ins = [x, delta, w] if add else [x, w]
    row = jax.ShapeDtypeStruct((m, e), x.dtype)
    res = pl.pallas_call(
        functools.partial(_kernel, e=e, bf=chunk(e), eps=float(eps), add=add),
        out_shape=[row, row] if add else [row], grid=(m,), interpret=interpret,
        name="add_rmsnorm", **triton_params(interpret, NUM_WARPS, num_stages=1),
    )(*ins)
    return (res[0], res[1]) if add else (x, res[0])
