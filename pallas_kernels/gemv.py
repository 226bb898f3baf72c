"""Batch-1 decode GEMV for compute-dtype (bf16) weights, with the layer's neighbours fused.

y [1, N] = p(x) @ w [K, N] (+ residual), w in the model's own layout (Linear.kernel, [in,
out], N contiguous), where the prologue p is
- "none":    x [1, K] as it is;
- "rmsnorm": RMSNorm(x) * norm_weight (model.RMSNorm's math: f32, rounded to x.dtype), so
             the norm is not a kernel of its own;
- "swiglu":  x [1, 2K] = [gate | up] (MLP.w_gateup's output), SiLU(gate) * up rounded to
             x.dtype like the model's, so the MLP's middle is not a kernel of its own;
and `residual` [1, N] is added in the epilogue (the decoder layer's x + h).

Why: at batch 1 every decoder layer ran ~12 small XLA kernels of ~1.3-1.7 us each (RMSNorm
reductions, residual adds, SiLU * up, converts) between its four GEMMs: 0.65 ms of a 4.95 ms
bf16 step (bench/results/history/profile_b1_bf16_6ef3735.json), and the small-N GEMMs (QKV, O) streamed
2.85 TB/s against 3.96 for gate/up (XLA's tiles leave SMs idle at N = 4096-6144).

Kernel (Pallas, Triton backend, like the other kernels here): grid (N // BN, splits). A
program owns BN output columns and one of `splits` K ranges; it streams [BK, BN] weight tiles
(each row BN contiguous elements) and keeps a [BN] f32 sum (reduce_each_step) or a [BK, BN]
one reduced at the end. With the RMSNorm prologue every program first reads all of x (K
elements from L2) for the inverse RMS. splits > 1 writes f32 partials [splits, 1, N] that XLA
adds (with the residual) in one small fusion.

Not used by the model: on the H200 (`python -m bench.gemv`, ten tilings per shape,
bench/results/history/gemv_b1_f8cae9d.json) its best tiling only tied XLA on the same fused
ops (rmsnorm + QKV 22.0 vs 22.5 us, O + residual 14.0 vs 14.2, swiglu + down 36.9 vs 35.6)
and lost on gate/up (74.4 vs 65.8 us: 3.16 against 3.57 TB/s), so the kernels it removes
would be paid back in GEMV time. It stays built, tested and timed for the next attempt (a
K-major weight copy for batch 1 is the untried layout).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import pow2_divisor, triton_params

PROLOGUES = ("none", "rmsnorm", "swiglu")
_MIN_PROGRAMS = 132     # one program per H200 SM at least


@dataclasses.dataclass(frozen=True)
class Tiles:
    bn: int = 64              # output columns per program (BN * 2 bytes per weight row read)
    bk: int = 256             # K rows per loop step
    splits: int = 1           # K ranges (f32 partials added outside when > 1)
    num_warps: int = 4
    num_stages: int = 3
    reduce_each_step: bool = True


def tiles_for(k: int, n: int, *, bn: int = 64, bk: int = 256, splits: int | None = None,
               **kw) -> Tiles:
    """Tiles for w [K, N]: BN and BK the largest powers of two <= the caps dividing N and K;
    splits (default) doubled while the grid has fewer than _MIN_PROGRAMS programs and each
    split keeps >= 4 steps."""
    bn, bk = pow2_divisor(n, bn), pow2_divisor(k, bk)
    if splits is None:
        splits, steps = 1, k // bk
        while (n // bn) * splits < _MIN_PROGRAMS and steps % (2 * splits) == 0 \
                and steps // (2 * splits) >= 4:
            splits *= 2
    return Tiles(bn=bn, bk=bk, splits=splits, **kw)


def _round(v, dtype):
    """v (f32) rounded to dtype and back: where the model materializes a dtype tensor."""
    return v.astype(dtype).astype(jnp.float32)


def _kernel(x_ref, w_ref, *refs, t: Tiles, k: int, prologue: str, eps: float,
            residual: bool, dtype):
    nw_ref = refs[0] if prologue == "rmsnorm" else None
    r_ref = refs[-2] if residual else None
    o_ref = refs[-1]
    j, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * t.bn, t.bn)
    steps = k // t.splits // t.bk
    k0 = s * (k // t.splits)

    if prologue == "rmsnorm":
        def squares(i, acc):
            v = x_ref[0, pl.ds(i * t.bk, t.bk)].astype(jnp.float32)
            return acc + v * v
        ss = lax.fori_loop(0, k // t.bk, squares, jnp.zeros((t.bk,), jnp.float32))
        inv = lax.rsqrt(jnp.sum(ss) / k + eps)

    def x_chunk(i):
        ks = pl.ds(k0 + i * t.bk, t.bk)
        v = x_ref[0, ks].astype(jnp.float32)
        if prologue == "rmsnorm":
            return _round(v * inv * nw_ref[ks].astype(jnp.float32), dtype)
        if prologue == "swiglu":
            up = x_ref[0, pl.ds(k + k0 + i * t.bk, t.bk)].astype(jnp.float32)
            return _round(_round(v * jax.nn.sigmoid(v), dtype) * up, dtype)
        return v

    def step(i, acc):
        w = w_ref[pl.ds(k0 + i * t.bk, t.bk), cols].astype(jnp.float32)      # [BK, BN]
        prod = w * x_chunk(i)[:, None]
        return acc + jnp.sum(prod, axis=0) if t.reduce_each_step else acc + prod

    acc0 = jnp.zeros((t.bn,) if t.reduce_each_step else (t.bk, t.bn), jnp.float32)
    acc = lax.fori_loop(0, steps, step, acc0)
    if not t.reduce_each_step:
        acc = jnp.sum(acc, axis=0)
    if t.splits > 1:
        o_ref[s, 0, cols] = acc
        return
    y = _round(acc, dtype)
    if residual:
        y = y + r_ref[0, cols].astype(jnp.float32)
    o_ref[0, cols] = y.astype(o_ref.dtype)


def _validate(x, w, prologue, norm_weight, residual):
    if prologue not in PROLOGUES:
        raise ValueError(f"gemv: prologue must be one of {PROLOGUES}, got {prologue!r}")
    if w.ndim != 2 or x.ndim != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv: x must be [1, K] and w [K, N], got {x.shape} and {w.shape}")
    k = w.shape[0]
    if x.shape[1] != (2 * k if prologue == "swiglu" else k):
        raise ValueError(f"gemv: x has {x.shape[1]} features, w [K, N] has K={k}"
                         + (" (swiglu takes [gate | up], 2K)" if prologue == "swiglu" else ""))
    if (prologue == "rmsnorm") != (norm_weight is not None):
        raise ValueError("gemv: norm_weight is required with, and only with, prologue "
                         "'rmsnorm'")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"gemv: norm_weight must be [{k}], got {norm_weight.shape}")
    if residual is not None and residual.shape != (1, w.shape[1]):
        raise ValueError(f"gemv: residual must be [1, {w.shape[1]}], got {residual.shape}")


@functools.partial(jax.jit, static_argnames=("prologue", "eps", "tiles", "interpret"))
def gemv(x, w, *, prologue: str = "none", norm_weight=None, eps: float = 1e-6,
         residual=None, tiles: Tiles | None = None, interpret: bool = False):
    """p(x) @ w (+ residual) -> [1, N] in x.dtype: see the module doc. Static: prologue, eps,
    tiles, interpret; x, w, norm_weight, residual are traced."""
    _validate(x, w, prologue, norm_weight, residual)
    k, n = w.shape
    t = tiles or tiles_for(k, n)
    if n % t.bn or k % (t.splits * t.bk):
        raise ValueError(f"gemv: tiles {t} do not divide w [{k}, {n}]")
    args = [x, w] + ([norm_weight] if norm_weight is not None else [])
    fused_residual = residual is not None and t.splits == 1
    args += [residual] if fused_residual else []
    out_shape = (jax.ShapeDtypeStruct((1, n), x.dtype) if t.splits == 1
                 else jax.ShapeDtypeStruct((t.splits, 1, n), jnp.float32))
    params = triton_params(interpret, t.num_warps, t.num_stages)
    y = pl.pallas_call(
        functools.partial(_kernel, t=t, k=k, prologue=prologue, eps=eps,
                          residual=fused_residual, dtype=x.dtype),
        out_shape=out_shape, grid=(n // t.bn, t.splits), interpret=interpret,
        name=f"jaxinfer_gemv_{prologue}", **params)(*args)
    if t.splits == 1:
        return y
    y = jnp.sum(y, axis=0).astype(x.dtype)
    return y if residual is None else (y.astype(jnp.float32)
                                       + residual.astype(jnp.float32)).astype(x.dtype)


def gemv_reference(x, w, *, prologue: str = "none", norm_weight=None, eps: float = 1e-6,
                   residual=None):
    """The model's own ops (model.RMSNorm, MLP's SiLU * up, Linear, the residual add)."""
    _validate(x, w, prologue, norm_weight, residual)
    if prologue == "rmsnorm":
        xf = x.astype(jnp.float32)
        x = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
             * norm_weight.astype(jnp.float32)).astype(x.dtype)
    elif prologue == "swiglu":
        gate, up = jnp.split(x, 2, axis=-1)
        x = jax.nn.silu(gate) * up
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if residual is None else y + residual
