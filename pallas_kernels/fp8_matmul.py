"""FP8-weight linear layer y = x @ W, three routes chosen by the token count M.

Weights come from checkpoints/fp8.py:quantize_linear: w_q float8_e4m3fn [N, K] (out, in:
K-major, the layout cuBLASLt's FP8 GEMM and Hopper's FP8 wgmma want) and a per-output-channel
f32 scale [N], so W[k, n] ~= w_q[n, k] * scale[n]. Here M counts tokens (T in model.py),
K the input features and N the output features of one projection.

Routes (M is static, so each bucket compiles exactly one; measured in docs/performance.md):
- M <= DEQUANT_MAX_M: x @ upcast(w_q) left to XLA, which fuses the fp8 -> bf16 convert into
  its own Triton GEMM; M < DEQUANT_PAD_M is padded to DEQUANT_PAD_M rows first: at M = 8
  XLA picks a faster GEMM than at M = 1 (and than our Pallas GEMV).
- M > DEQUANT_MAX_M (prefill): XLA's cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8` in the HLO)
  on x quantized per token to e4m3, writing a bf16 product (f32 for f32 x) that both scales
  are applied to. The model's FP8 MLP on this route fuses its middle (SiLU * up and the down
  projection's quantization) into one kernel: pallas_kernels/swiglu_quant.py.
- The Pallas (Triton backend) skinny kernel below: used for M == 1 only when the caller
  passes a stacked weight with `layer` (below). It streams the fp8 weight once, converts it in
  registers and applies the channel scale in its epilogue; each program owns a few output
  channels ([BN, K] of w_q), and when N // BN alone gives too few programs for the 132 SMs,
  K is split too and XLA adds the f32 partial sums. M == 1 is a GEMV on CUDA cores (tiles in
  pallas_kernels/tuning.py); M > 1 pads x to a power of two >= 16 and uses bf16 tensor-core
  dots. Its best tilings stay below XLA's route above, so it is not the default; it stays
  built and tested (`skinny_fp8_matmul`).

`layer` lets a decoder that scans over layers pass the whole stacked weight ([L, N, K], [L, N])
plus the layer index: the kernel then indexes the layer itself, so XLA never copies a layer's
weight slice out of the stack before the custom call (the same reason the KV cache keeps L).

Static/dynamic: shapes, dtypes and `interpret` are static (a new M bucket compiles once);
x, w_q, scale and layer are dynamic.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import FP8_DTYPE, FP8_MAX, pow2_ceil, pow2_divisor, triton_params
from pallas_kernels.tuning import FP8_GEMV

PALLAS_MAX_M = 0     # the Pallas kernel only for stacked weights (`layer`); see above
DEQUANT_PAD_M = 8    # M < 8 padded to 8 rows for XLA's fused-dequant GEMM
DEQUANT_MAX_M = 64   # M > 64: the FP8 tensor-core GEMM wins (2048: 1.1-1.2x over bf16)
TC_PRODUCT_DTYPE = jnp.bfloat16   # the tensor-core GEMM's output for bf16 x (see below)
# x's quantization (x_q, x_scale) materialized behind an optimization barrier. Without it XLA
# fuses x_scale's whole computation (x's producer, e.g. residual add + RMSNorm, then the row
# amax) into the product's consumers and recomputes it for every output tile (e.g. the SiLU *
# up fusion redoing the MLP input's RMSNorm and amax); docs/performance.md has the gain.
QUANT_BARRIER = True
_MIN_PROGRAMS = 2 * 132    # two programs per H200 SM, so one slow SM does not set the pace
_CONTRACT_K = (((1,), (1,)), ((), ()))   # x [M, K] . w [N, K] -> [M, N]


@dataclasses.dataclass(frozen=True)
class Tiles:
    mp: int        # rows of x the kernel sees: 1 (GEMV) or M padded to a power of two >= 16
    bn: int        # output channels per program
    bk: int        # K elements per loop step
    splits: int    # K splits (partial sums added by XLA when > 1)
    num_warps: int = 4
    num_stages: int = 3
    # GEMV (mp == 1) only: reduce each step's [BN, BK] products to [BN] at once (registers
    # freed for loads in flight; costs a cross-lane reduction per step) instead of keeping
    # a [BN, BK] f32 accumulator to the end; and how many tiles ahead the loads run.
    reduce_each_step: bool = False
    prefetch: int = 1


def skinny_tiles(m: int, k: int, n: int, *, bn_cap: int | None = None,
                 bk_cap: int | None = None, num_warps: int | None = None,
                 reduce_each_step: bool | None = None, prefetch: int | None = None,
                 tensor_cores: bool = False, num_stages: int = 3) -> Tiles | None:
    """Tile choice for the decode kernel, or None when the shape does not tile.
    Defaults for M == 1 come from pallas_kernels/tuning.py's FP8_GEMV; the arguments
    override them (to compare tile variants). tensor_cores: M == 1
    too goes through the tensor-core dot path, x padded to 16 rows."""
    g = FP8_GEMV
    mp = 1 if m == 1 and not tensor_cores else max(16, pow2_ceil(m))
    gemv = mp == 1
    # x is re-read from L2 by every program: BN >= Mp/2 keeps that traffic near the weight's.
    bn = pow2_divisor(n, bn_cap or (g.bn if gemv else max(16, mp // 2)))
    # 3 stages of a [128, 256] bf16 x tile overflow shared memory (seen on the H200).
    bk = pow2_divisor(k, bk_cap or (g.bk if gemv else 256 if mp < 128 else 128))
    if prefetch is None:
        prefetch = g.prefetch if gemv else 1
    min_tile = 1 if gemv else 16   # tensor-core dots need 16 along each axis
    if bn < min_tile or bk < max(16, min_tile):
        return None
    if prefetch < 1:
        raise ValueError(f"skinny_tiles: prefetch must be >= 1, got {prefetch}")
    splits, steps = 1, k // bk
    while ((n // bn) * splits < _MIN_PROGRAMS and steps % (splits * 2) == 0
           and steps // (splits * 2) >= prefetch):   # each split keeps `prefetch` steps
        splits *= 2
    return Tiles(mp, bn, bk, splits, num_warps or (g.num_warps if gemv else 4), num_stages,
                 reduce_each_step=g.reduce_each_step if reduce_each_step is None
                 else reduce_each_step, prefetch=prefetch)


def _gemv_sum(x_ref, w_ref, layer, chans, k0, steps, t: Tiles):
    """M == 1 on CUDA cores: [BN] partial dot products over K range [k0, k0 + steps * BK).

    The weight tiles of the next `t.prefetch` steps are loaded before this step's math
    (carried in the loop), so each thread keeps that many tiles' loads in flight. Lanes
    stay apart in an elementwise [BN, BK] accumulator reduced once at the end, or, with
    t.reduce_each_step, each step's products are summed to [BN] right away."""
    def load(i):
        i = jnp.minimum(i, steps - 1)              # the last steps re-read a tile (L2 hit)
        return w_ref[layer, chans, pl.ds(k0 + i * t.bk, t.bk)]           # [BN, BK] fp8

    def step(i, carry):
        acc, tiles = carry
        w, tiles = tiles[0], tiles[1:] + (load(i + t.prefetch),)
        x = x_ref[0, pl.ds(k0 + i * t.bk, t.bk)].astype(jnp.float32)     # [BK]
        prod = w.astype(jnp.float32) * x[None, :]
        return (acc + jnp.sum(prod, axis=1) if t.reduce_each_step else acc + prod), tiles

    acc0 = jnp.zeros((t.bn,) if t.reduce_each_step else (t.bn, t.bk), jnp.float32)
    first = tuple(load(j) for j in range(t.prefetch))
    acc, _ = lax.fori_loop(0, steps, step, (acc0, first))
    return acc if t.reduce_each_step else jnp.sum(acc, axis=1)           # [BN]


def _dot_sum(x_ref, w_ref, layer, chans, k0, steps, t: Tiles):
    """M > 1 on tensor cores: [Mp, BN] partial products; fp8 -> bf16 is exact."""
    def step(i, acc):
        cols = pl.ds(k0 + i * t.bk, t.bk)
        w = w_ref[layer, chans, cols].astype(jnp.bfloat16)               # [BN, BK]
        x = x_ref[:, cols].astype(jnp.bfloat16)                          # [Mp, BK]
        return acc + lax.dot_general(x, w, _CONTRACT_K, preferred_element_type=jnp.float32)

    return lax.fori_loop(0, steps, step, jnp.zeros((t.mp, t.bn), jnp.float32))


def _skinny_kernel(layer_ref, x_ref, w_ref, s_ref, o_ref, *, t: Tiles, k: int):
    """One program: output channels [n*BN, (n+1)*BN) over the K range of split s."""
    n, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    chans = pl.ds(n * t.bn, t.bn)
    steps = k // t.splits // t.bk
    k0 = s * (k // t.splits)
    if t.mp == 1:
        acc = _gemv_sum(x_ref, w_ref, layer, chans, k0, steps, t)         # [BN]
        rows, chan_scale = 0, s_ref[layer, chans]
    else:
        acc = _dot_sum(x_ref, w_ref, layer, chans, k0, steps, t)          # [Mp, BN]
        rows, chan_scale = slice(None), s_ref[layer, chans][None, :]
    if t.splits == 1:   # epilogue: channel scale and output cast, no second kernel
        o_ref[rows, chans] = (acc * chan_scale).astype(o_ref.dtype)
    else:
        o_ref[s, rows, chans] = acc


def skinny_fp8_matmul(x, w_q, scale, layer, t: Tiles, *, interpret: bool = False):
    """The decode kernel on stacked weights: x [M, K], w_q [L, N, K], scale [L, N], layer [1]."""
    m, k = x.shape
    n = w_q.shape[1]
    xp = x if t.mp == m else jnp.pad(x, ((0, t.mp - m), (0, 0)))
    if t.splits == 1:
        out_shape = jax.ShapeDtypeStruct((t.mp, n), x.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((t.splits, t.mp, n), jnp.float32)
    params = triton_params(interpret, t.num_warps, t.num_stages)
    y = pl.pallas_call(
        functools.partial(_skinny_kernel, t=t, k=k),
        out_shape=out_shape,
        grid=(n // t.bn, t.splits),
        interpret=interpret,
        **params,
    )(layer, xp, w_q, scale)
    if t.splits > 1:
        y = (jnp.sum(y, axis=0) * scale[layer[0]][None, :]).astype(x.dtype)
    return y[:m]


def amax_scale(amax):
    """The activations' e4m3 scale from their amax: amax / 448, 1 for an all-zero row."""
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def e4m3_codes(xf, scale, dtype=FP8_DTYPE):
    """f32 values over their (broadcast) scale, rounded to e4m3 (saturating at +-448)."""
    return e4m3_saturate(xf / scale, dtype)


def e4m3_saturate(xf, dtype=FP8_DTYPE):
    """f32 values already in code units, rounded to e4m3 (saturating at +-448)."""
    return jnp.clip(xf, -FP8_MAX, FP8_MAX).astype(dtype)


def quantize_rows(x, per_token: bool = True):
    """x [M, K] -> (e4m3 [M, K], f32 scale): amax / 448 per row ([M, 1]), or over all of x
    ([1, 1]) with per_token=False. The fused kernels (swiglu_quant, norm_quant) use the same
    amax_scale and e4m3_codes."""
    xf = x.astype(jnp.float32)
    scale = amax_scale(jnp.max(jnp.abs(xf), axis=1 if per_token else None, keepdims=True))
    return e4m3_codes(xf, scale), scale


def tc_quantize(x, per_token: bool = True):
    """The tensor-core route's activation quantization, behind the barrier (QUANT_BARRIER)."""
    x_q, x_scale = quantize_rows(x, per_token)
    return lax.optimization_barrier((x_q, x_scale)) if QUANT_BARRIER else (x_q, x_scale)


def tc_product(x_q, w_q, like, product_dtype=None):
    """x_q [M, K] e4m3 @ w_q [N, K]^T on the FP8 tensor cores, unscaled, in product_dtype
    (default TC_PRODUCT_DTYPE when `like` (the activations' dtype) is bf16, else f32)."""
    if product_dtype is None:
        product_dtype = TC_PRODUCT_DTYPE if like == jnp.bfloat16 else jnp.float32
    return lax.dot_general(x_q, w_q, _CONTRACT_K, preferred_element_type=product_dtype)


def tensor_core_fp8_matmul(x, w_q, scale, product_dtype=None, per_token=True):
    """Prefill route: x quantized per token to e4m3, cuBLASLt FP8 GEMM, scales on the product.

    product_dtype: the GEMM's output; default TC_PRODUCT_DTYPE for bf16 x, else f32. A bf16
    product halves the bytes the GEMM writes and its consumers (scales, SiLU, the next
    quantization) read back; its rounding (2^-9) is far below e4m3's (2^-4).
    per_token=False quantizes x with one scale for the whole [M, K] (a variant to compare)."""
    x_q, x_scale = tc_quantize(x, per_token)
    return tc_scaled(tc_product(x_q, w_q, x.dtype, product_dtype), x_scale, scale, x.dtype)


def tc_scaled(y, x_scale, scale, dtype):
    """The tensor-core route's epilogue: the product y [M, N] times the activations' per-token
    scales [M, 1] and the weight's per-channel scales [N], in f32, cast to dtype."""
    return (y.astype(jnp.float32) * x_scale * scale[None, :]).astype(dtype)


def xla_dequant_matmul(x, w_q, scale):
    """Small-M route: XLA fuses the fp8 -> bf16 convert into its GEMM; scale on the product."""
    y = lax.dot_general(x.astype(jnp.bfloat16), w_q.astype(jnp.bfloat16), _CONTRACT_K,
                        preferred_element_type=jnp.float32)
    return (y * scale[None, :]).astype(x.dtype)


def _validate(x, w_q, scale, layer):
    stacked = layer is not None
    if x.ndim != 2:
        raise ValueError(f"fp8_linear: x must be [M, K], got shape {x.shape}")
    if w_q.dtype != FP8_DTYPE:
        raise TypeError(f"fp8_linear: w_q must be float8_e4m3fn (from quantize_linear), "
                        f"got {w_q.dtype}")
    if w_q.ndim != (3 if stacked else 2) or scale.shape != w_q.shape[:-1]:
        want = "[L, N, K] and [L, N] with layer=" if stacked else "[N, K] and [N]"
        raise ValueError(f"fp8_linear: w_q/scale must be {want}, got {w_q.shape} and "
                         f"{scale.shape}")
    if x.shape[1] != w_q.shape[-1]:
        raise ValueError(f"fp8_linear: x has K={x.shape[1]} features but w_q [.., N, K] has "
                         f"K={w_q.shape[-1]} (w_q is stored out x in, see quantize_linear)")


@functools.partial(jax.jit, static_argnames=("interpret",))
def fp8_linear(x, w_q, scale, *, layer=None, interpret: bool = False):
    """y [M, N] = x [M, K] @ W in x.dtype, W given as (w_q [N, K] fp8, scale [N] f32).

    With `layer` (an int32 scalar), w_q is [L, N, K] and scale [L, N]: see the module doc
    (at M == 1 the Pallas kernel then indexes the layer itself, no slice is copied).
    On a machine without a GPU and interpret=False this runs the reference; with
    interpret=True the Pallas route runs in interpret mode and the XLA routes as they are.
    """
    _validate(x, w_q, scale, layer)
    stacked = layer is not None
    if not stacked:
        w_q, scale, layer = w_q[None], scale[None], jnp.zeros((1,), jnp.int32)
    else:
        layer = jnp.asarray(layer, jnp.int32).reshape(1)
    m, k = x.shape
    t = skinny_tiles(m, k, w_q.shape[1])
    if not (interpret or jax.default_backend() == "gpu"):
        return fp8_linear_reference(x, w_q[layer[0]], scale[layer[0]])
    if t is not None and (m <= PALLAS_MAX_M or (stacked and m == 1)):
        return skinny_fp8_matmul(x, w_q, scale, layer, t, interpret=interpret)
    if m <= DEQUANT_MAX_M:
        xp = jnp.pad(x, ((0, DEQUANT_PAD_M - m), (0, 0))) if m < DEQUANT_PAD_M else x
        return xla_dequant_matmul(xp, w_q[layer[0]], scale[layer[0]])[:m]
    return tensor_core_fp8_matmul(x, w_q[layer[0]], scale[layer[0]])


def fp8_linear_reference(x, w_q, scale):
    """Plain jnp: x [M, K] @ dequantized W in f32 (highest precision), cast to x.dtype."""
    w = w_q.astype(jnp.float32) * scale[:, None].astype(jnp.float32)     # [N, K]
    y = lax.dot_general(x.astype(jnp.float32), w, _CONTRACT_K,
                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
