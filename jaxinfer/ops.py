"""The one switch between Pallas kernels and their plain-jnp references.

`impl` is static ("reference" | "pallas"; EngineConfig's "auto" is resolved by
`resolve_attention_impl` before tracing): changing it means a different compiled step.

Tensor parallelism (sharding.py): GSPMD cannot partition a Pallas kernel, so on a mesh the
kernels (and, for one code path, their references) run under `shard_map`: attention on its
device's kv heads (all of them when attention is replicated), FP8 linears on their weight
shard — a row-parallel one sums its partial products across the mesh itself.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer import kv_cache
from jaxinfer.kv_cache import FP8_DTYPE, AttentionMetadata, KVCache
from jaxinfer.sharding import AXIS, TPLayout, kv_spec


FUSED_FP8_MLP = True   # fused_fp8_mlp on (a module switch for in-process A/B benches)
PALLAS_KV_WRITE = True  # write_kv's Pallas kernel with impl "pallas" (the same kind of switch)
FUSED_NORM_QUANT = True  # fused_fp8_layer (the same kind of switch)
# bf16 (compute-dtype) linears with fewer rows than this are padded to it on the GPU, like the
# FP8 route's DEQUANT_PAD_M: XLA's GEMM at M = 8 beats its M = 1 one. The 8B bf16 decode step
# at context 512 ran 5.04 ms at batch 1 and 4.82 ms at batch 8 (eight rows of attention
# included; H200, one process, bench/README.md tenth session). 1 turns the pad off. With
# DECODE_MIN_ROWS below, what it still pads on the GPU is mainly the LM head of steps with
# fewer than 8 rows (its input is the B sampled rows, taken after the decoder's slice).
BF16_PAD_M = 8
# Decode steps with fewer rows than this run padded to it on the GPU (model.Decoder pads the
# tokens and metadata once, kv_cache.pad_decode_rows; attention runs on the real rows), so
# no linear needs BF16_PAD_M's or DEQUANT_PAD_M's per-layer pad and slice: the 8B batch-1
# step has 591 kernels instead of 654. H200, decode harness, batch 1 (eleventh session): back
# to back 4.55-4.58 vs 4.63-4.71 ms bf16, 3.11-3.14 vs 3.25-3.28 ms FP8; one request through
# the engine: tok/s unchanged within its noise, the host's dispatch 0.97-0.99 vs 1.41 ms
# (bf16). 1 turns it off.
DECODE_MIN_ROWS = 8
# The decoder layer's glue as Pallas kernels (GPU: compiled; elsewhere with impl "pallas":
# interpret mode): RoPE, the QKV split and the K/V write in one (pallas_kernels/kv_write.py's
# rope_write_kv, with impl "pallas"), and each residual add with the RMSNorm after it in one
# (pallas_kernels/rmsnorm.py, on the GPU; now behind PALLAS_ADD_NORM, off: XLA's fusion of
# the add and the norm is faster, below). H200, twelfth session (bench/README.md): the 8B
# batch-1 step's kernels 591 -> 430, its time unchanged (back to back 4.18-4.27 ms on vs
# 4.16-4.24 off, one process per run; the fused kernels take 2.4-2.6 us each where XLA's
# took 1.3-1.8); B=64/256 and one request through the engine within noise. Kept for the
# kernel count, not for speed. False turns both off (in-process A/B). Like the switches
# above, it is read when a step is traced: a runner's step keeps what its first trace saw,
# and model._unrolled_layer (shared by all runners) keys its trace cache on `switches()`.
FUSED_GLUE = True
# Under FUSED_GLUE, the residual add + RMSNorm as the Pallas kernel (pallas_kernels/rmsnorm.py)
# instead of XLA's fusion of the same jnp. Off: on the H200 (fourteenth session, decode
# harness B=1 C=512 back to back, one process per run, runs of one call interleaved) XLA's
# route ran 8B bf16 4.159 / 4.194 ms vs 4.238 / 4.225, Qwen2.5-32B FP8 + FP8 KV 9.740 vs
# 10.007, 8B FP8 weights 2.855 vs 2.839; alone, chained, the kernel took 1.8-2.7 us per
# [8, 4096..5120] call and XLA's add + norm (+ an add) 0.7-0.8 us.
PALLAS_ADD_NORM = False
# Decode steps of at most this many rows (the GPU pads batch 1 to DECODE_MIN_ROWS) run QKV
# as QKV_PARTS partial products over slices of the hidden dim, summed with the channel
# scales, the bias and RoPE inside the decode attention kernel, which writes the new K/V
# too (pallas_kernels/decode_qkv.py): two kernels per layer fewer (XLA's split-K sum and the
# RoPE + K/V write kernel). 0 turns it off; JAXINFER_DECODE_QKV_ROWS sets it at import (A/B).
FUSED_DECODE_QKV_MAX_ROWS = int(os.environ.get("JAXINFER_DECODE_QKV_ROWS", "8"))
QKV_PARTS = int(os.environ.get("JAXINFER_QKV_PARTS", "4"))   # the same (A/B)
# Under the fused front, a split decode grid can merge its splits in its last-arriving
# program (pallas_kernels/split_combine.py, last_combines_in_kernel) instead of in
# split_combine's kernel: one kernel per layer fewer. The programs count themselves in on
# per-step zeros (combine_counters) that the decoder hands from layer to layer in the cache.
# Off: on the H200 (thirty-third session, bench/results/last_combines.json, batch 1, context
# 512, device step, one machine) it did not pay: 8B FP8 2.772 / 2.807 ms on against
# 2.725-2.798 off, bf16 4.134 against 4.118-4.198, Qwen2.5-32B FP8 + FP8 KV 9.987 against
# 9.533-9.588 (candidates, not taken apart: every program now waits for an atomic after a
# barrier, and the last one reads the partials with volatile loads). Correct on the GPU
# (tests/test_decode_qkv.py).
# JAXINFER_LAST_COMBINES=1 turns it on at import (A/B).
LAST_COMBINES = os.environ.get("JAXINFER_LAST_COMBINES", "0") == "1"
# Under the fused front, the RMSNorm before QKV folded into it (front_norm_applies): QKV's
# partial products take x times the norm's weight, and the decode kernel scales each row's
# sum by 1 / rms(x), a scalar per row, which it computes from x itself
# (pallas_kernels/decode_qkv.py, norm_factor): the norm's own kernel goes, one per layer.
# H200, fortieth session (bench/results/front_norm_ab.json, device step, batch 1, context
# 512, one machine): the 8B FP8 + int8 head step 372 -> 340 kernels but no faster (medians of
# six interleaved pairs 2.6728 ms on vs 2.6732 off: the front took ~1 us more per layer,
# 5.8 -> 6.8 us, by the profiles), bf16 4.124 vs 4.181 (three pairs, -1.4%), Qwen2.5-32B FP8
# 9.662 vs 9.730 (one pair). JAXINFER_FRONT_NORM=0 turns it off at import (A/B).
FRONT_NORM = os.environ.get("JAXINFER_FRONT_NORM", "1") == "1"
# Where FRONT_NORM folds the first RMSNorm, fold the MLP's too (model.MLP's `norm`): gate/up
# take x times the norm's weight and SiLU * up each row's 1 / rms(x). Off: on the H200 (8B
# FP8 batch-1 step, profile, 40th session) XLA computes the factor in a reduce kernel of its
# own, in place of the norm's: 340 kernels per step either way, busy 2.697 against 2.695 ms.
# JAXINFER_FOLD_MLP_NORM=1 turns it on at import (A/B).
FOLD_MLP_NORM = os.environ.get("JAXINFER_FOLD_MLP_NORM", "0") == "1"


def switches() -> tuple:
    """This module's switches (and the decode attention kernel's: its longest-first window
    and masked-loads threshold), as a key for a trace cache shared across runners."""
    from pallas_kernels import tuning
    return (FUSED_FP8_MLP, PALLAS_KV_WRITE, FUSED_NORM_QUANT, BF16_PAD_M, FUSED_GLUE,
            PALLAS_ADD_NORM, FUSED_DECODE_QKV_MAX_ROWS, QKV_PARTS, LAST_COMBINES, FRONT_NORM,
            FOLD_MLP_NORM, tuning.LONGEST_FIRST_PROGRAMS, tuning.MASKED_LOADS_MIN_PROGRAMS)


def _on_gpu() -> bool:
    """Kernels run compiled on the GPU; elsewhere "pallas" means interpret mode (tests)."""
    return jax.default_backend() == "gpu"


def decode_rows(rows: int) -> int:
    """The rows a decode step of `rows` rows runs with: at least DECODE_MIN_ROWS on the GPU."""
    return max(rows, DECODE_MIN_ROWS) if _on_gpu() else rows


def resolve_attention_impl(impl: str) -> str:
    if impl != "auto":
        return impl
    return "pallas" if _on_gpu() else "reference"


def write_kv(kv: KVCache, layer, k, v, slot_mapping, *, impl: str,
             layout: TPLayout = TPLayout()) -> KVCache:
    """The new tokens' K/V ([T, K, D]) into their pages: with impl "pallas" one kernel
    (pallas_kernels/kv_write.py; interpret mode off the GPU), else, and under tensor
    parallelism, XLA's scatter (kv_cache.write_kv)."""
    from pallas_kernels import kv_write as kw
    if PALLAS_KV_WRITE and impl == "pallas" and layout.size == 1 and kw.supported(kv):
        return kw.write_kv(kv, layer, k, v, slot_mapping, interpret=not _on_gpu())
    return kv_cache.write_kv(kv, layer, k, v, slot_mapping)


def rope_write_kv(kv: KVCache, layer, qkv, cos, sin, slot_mapping, *, num_heads: int,
                  impl: str, layout: TPLayout = TPLayout(), bias=None, scales=None):
    """RoPE on the fused QKV projection's output and the K/V write in one kernel: -> (q
    [T, H, D] rotated, the cache), or None where it does not apply (the caller's route:
    split, model.apply_rope, write_kv): FUSED_GLUE off, impl "reference", tensor
    parallelism, or a head dim the kernel does not take. bias: the projection's bias, added
    in the kernel (qkv then comes without it), or None; scales: (x_scale [T, 1], w_scale
    [(H+2K)D]) of an unscaled FP8 tensor-core product (fp8_tc_product_q), applied in the
    kernel, or None."""
    from pallas_kernels import kv_write as kw
    if not (FUSED_GLUE and PALLAS_KV_WRITE and impl == "pallas" and layout.size == 1
            and kw.supported(kv)):
        return None
    kv, q = kw.rope_write_kv(kv, layer, qkv, cos, sin, slot_mapping, num_heads=num_heads,
                             bias=bias, scales=scales, interpret=not _on_gpu())
    return q, kv


def _front_applies(t: int, md: AttentionMetadata, impl: str, layout: TPLayout) -> bool:
    return (FUSED_GLUE and impl == "pallas" and layout.size == 1 and md.decode_only
            and t <= FUSED_DECODE_QKV_MAX_ROWS)


def combine_counters(t: int, kv_heads: int, md: AttentionMetadata, *, impl: str,
                     layout: TPLayout = TPLayout()):
    """Zeros [T * K] f32 for a decode step of T rows that decode_qkv_attention may run with
    the in-kernel combine (LAST_COMBINES), else None. The decoder puts them in each layer's
    cache (KVCache.counters) and takes them back out: every kernel leaves them zero."""
    if not (LAST_COMBINES and _front_applies(t, md, impl, layout)):
        return None
    return jnp.zeros((t * kv_heads,), jnp.float32)


def _front_blocks(x, kv: KVCache, md: AttentionMetadata, impl: str, layout: TPLayout):
    """The decode table's blocks the fused front would read this cache with, or None where
    the front does not apply (decode_qkv_attention's list)."""
    from pallas_kernels import decode_qkv as dq
    t = x.shape[0]
    if not (_front_applies(t, md, impl, layout) and x.shape[1] % QKV_PARTS == 0):
        return None
    blocks = dq.table_blocks(kv, md.page_table, md.attend_rows or t)
    return blocks if dq.supported(kv, blocks) else None


def front_norm_applies(x, kv: KVCache, md: AttentionMetadata, impl: str,
                       layout: TPLayout = TPLayout()) -> bool:
    """Whether the decoder hands decode_qkv_attention the residual rows x [T, E] times the
    RMSNorm's weight, with the rows and eps as `norm`, instead of the normed rows: FRONT_NORM
    and the front applies."""
    return FRONT_NORM and _front_blocks(x, kv, md, impl, layout) is not None


def decode_qkv_attention(x, kernel, scale, bias, kv: KVCache, layer, md: AttentionMetadata,
                         cos, sin, *, num_heads: int, sm_scale: float, impl: str,
                         layout: TPLayout = TPLayout(), norm=None):
    """QKV's projection of x [T, E] (kernel and FP8 scale as the Linear holds them, bias or
    None), RoPE, the K/V write and decode attention with the projection's sum, scales, bias
    and RoPE inside the attention kernel (pallas_kernels/decode_qkv.py) -> (out [T, H, D],
    the cache); None where that does not apply (the caller's unfused route): not a decode
    step of <= FUSED_DECODE_QKV_MAX_ROWS rows, impl "reference", tensor parallelism,
    FUSED_GLUE off, a hidden size QKV_PARTS does not divide or a head dim the kernel does
    not take (decode_qkv.supported). FP8 KV is read as plain rows (decode_qkv.table_blocks).
    norm (rows [T, E], eps): the RMSNorm before QKV folded in (FRONT_NORM): x is those
    residual rows times the norm's weight, and the kernel scales each row's sum by
    1 / rms(rows)."""
    from pallas_kernels import decode_qkv as dq
    blocks = _front_blocks(x, kv, md, impl, layout)
    if blocks is None:
        return None
    t = x.shape[0]
    n = md.attend_rows or t
    rows, eps = (None, None) if norm is None else norm
    return dq.paged_attention_qkv(dq.partial_products(x, kernel, QKV_PARTS), scale, bias, cos,
                                  sin, kv, layer, md.seq_lens, md.page_table, md.slot_mapping,
                                  num_heads=num_heads, sm_scale=sm_scale, dtype=x.dtype,
                                  interpret=not _on_gpu(), rows=n if n < t else None,
                                  longest_first=None, blocks=blocks, x=rows, norm_eps=eps)


def add_rmsnorm(x, delta, weight, *, eps: float, layout: TPLayout = TPLayout()):
    """x + delta (delta None: x) and its RMSNorm times `weight` -> (x after the add, the
    normed rows): its plain-jnp reference, which XLA fuses; one Pallas kernel
    (pallas_kernels/rmsnorm.py) on the GPU with FUSED_GLUE and PALLAS_ADD_NORM on and no
    tensor parallelism."""
    from pallas_kernels import rmsnorm
    if FUSED_GLUE and PALLAS_ADD_NORM and _on_gpu() and layout.size == 1:
        return rmsnorm.add_rmsnorm(x, weight, delta, eps=eps)
    return rmsnorm.add_rmsnorm_reference(x, weight, delta, eps=eps)


def attention(q, kv: KVCache, layer, md: AttentionMetadata, *, sm_scale: float, impl: str,
              layout: TPLayout = TPLayout()):
    """q [T, H, D] over the paged cache (the new tokens' K/V already written) -> [T, H, D]."""
    if layout.size == 1:
        return _attention(q, kv, layer, md, sm_scale=sm_scale, impl=impl)
    heads = P(None, AXIS) if layout.attn > 1 else P()      # q/out [T, H, D] and the cache
    fn = jax.shard_map(lambda q, kv, layer, md: _attention(q, kv, layer, md, sm_scale=sm_scale,
                                                            impl=impl),
                       mesh=layout.mesh, in_specs=(heads, kv_spec(layout), P(), P()),
                       out_specs=heads, check_vma=False)
    return fn(q, kv, layer, md)


def _attention(q, kv: KVCache, layer, md: AttentionMetadata, *, sm_scale: float, impl: str):
    from pallas_kernels import paged_attention as pa
    from pallas_kernels import ragged_paged_attention as rpa

    interpret = not _on_gpu()
    if md.decode_only:
        rows = q.shape[0]
        n = md.attend_rows or rows          # rows past n: padding (kv_cache.pad_decode_rows)
        if impl == "pallas":                # the kernel skips (and zeroes) the padding itself
            return pa.paged_attention(q, kv.k, kv.v, layer, md.seq_lens, md.page_table,
                                      kv.k_scale, kv.v_scale, sm_scale=sm_scale,
                                      interpret=interpret, rows=n if n < rows else None,
                                      longest_first=None)
        o = pa.paged_attention_reference(q[:n], kv.k, kv.v, layer, md.seq_lens[:n],
                                         md.page_table[:n], kv.k_scale, kv.v_scale,
                                         sm_scale=sm_scale)
        return o if n == rows else jnp.pad(o, ((0, rows - n), (0, 0), (0, 0)))
    fn = rpa.ragged_paged_attention if impl == "pallas" else rpa.ragged_paged_attention_reference
    return fn(q, kv.k, kv.v, layer, md, kv.k_scale, kv.v_scale, sm_scale=sm_scale,
              interpret=interpret)


def linear(x, kernel, scale=None, bias=None, parallel=None):
    """x [M, in] @ kernel -> [M, out]. FP8 kernels (with their per-channel `scale`) go to the
    FP8 matmul, which picks its own route by M; others are a plain dot XLA fuses around (and
    GSPMD partitions), M padded to BF16_PAD_M rows on the GPU. parallel: (layout, "col" |
    "row") for a sharded kernel."""
    if kernel.dtype == FP8_DTYPE:
        y = _fp8_linear(x, kernel, scale) if parallel is None else _fp8_sharded(
            x, kernel, scale, *parallel)
    else:
        m = x.shape[0]
        pad = BF16_PAD_M - m if _on_gpu() else 0
        xp = jnp.pad(x, ((0, pad), (0, 0))) if pad > 0 else x
        y = jnp.dot(xp, kernel.astype(x.dtype), preferred_element_type=jnp.float32)
        y = y[:m].astype(x.dtype)
    return with_bias(y, bias)


def int8_head(x, codes, scale):
    """x [M, E] @ an int8 LM head (codes [V, E], per-vocab-row scale [V]) -> f32 logits
    [M, V]: the codes widened to x's dtype in the GEMM's operand (XLA fuses the convert),
    the scale applied to the f32 product; M padded to BF16_PAD_M rows on the GPU, as the
    bf16 head. Half the bf16 head's bytes: 4096 x 128256 at batch 1 on the H200 136 vs 235
    us; at 256-512 rows, where the head is compute-bound, 1.6x the bf16 head's time (XLA's
    own GEMM fusion against cuBLAS: bench/results/lm_head.json, lm_head_large_m.json)."""
    m = x.shape[0]
    pad = BF16_PAD_M - m if _on_gpu() else 0
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad > 0 else x
    y = jax.lax.dot_general(xp, codes.astype(x.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y[:m] * scale[None, :].astype(jnp.float32)


def with_bias(y, bias):
    """y + bias in y's dtype (bias None: y): how a Linear's bias is added."""
    return y if bias is None else y + bias.astype(y.dtype)


def fused_fp8_mlp(x, gateup, down):
    """The FP8 MLP with SiLU * up and the down projection's quantization in one kernel
    (pallas_kernels/swiglu_quant.py), or None where it does not apply: off the GPU, with
    bf16 weights, or at M <= DEQUANT_MAX_M (the fused-dequant route has no quantization to
    fuse). gateup/down: (kernel, scale) of the unsharded FP8 linears."""
    from pallas_kernels import swiglu_quant as sq
    (wgu, sgu), (wd, sd) = gateup, down
    if not _fp8_mlp_applies(x, wgu, wd):
        return None
    return sq.fp8_mlp(x, wgu, sgu, wd, sd)


def _fp8_mlp_applies(x, w_first, w_down) -> bool:
    """The fused FP8 MLP's conditions: on the GPU, FP8 weights (w_first: the layer's first
    FP8 linear), M > DEQUANT_MAX_M and an F swiglu_quant takes."""
    from pallas_kernels import fp8_matmul as fm
    from pallas_kernels import swiglu_quant as sq
    return (FUSED_FP8_MLP and _on_gpu() and w_first.dtype == FP8_DTYPE
            and x.shape[0] > fm.DEQUANT_MAX_M and sq.supported(w_down.shape[-1]))


def fused_fp8_layer(x, wqkv, w_down, shards: int) -> bool:
    """Whether a decoder layer runs its FP8 tensor-core route with the RMSNorms fused into
    the quantizations (norm_quant, fp8_tc_product_q, fp8_mlp_quantized; model.DecoderLayer):
    on the GPU, one device, FP8 weights, M > DEQUANT_MAX_M and widths the kernels take."""
    from pallas_kernels import norm_quant as nq
    return (FUSED_NORM_QUANT and shards == 1 and _fp8_mlp_applies(x, wqkv, w_down)
            and nq.supported(x.shape[1]))


def norm_quant(x, weight, delta=None, *, eps: float):
    """RMSNorm(x + delta) quantized per token to e4m3 (pallas_kernels/norm_quant.py):
    -> (x after the add or None, codes [M, E], scales [M, 1])."""
    from pallas_kernels import norm_quant as nq
    return nq.norm_quant(x, weight, delta, eps=eps, interpret=not _on_gpu())


def fp8_tc_product_q(x_q, kernel, dtype):
    """The unscaled FP8 tensor-core product of activations already quantized per token; its
    scales are left to the consumer (tc_scaled's epilogue; the RoPE kernel takes them)."""
    from pallas_kernels import fp8_matmul as fm
    return fm.tc_product(x_q, kernel, dtype)


def tc_scaled(y, x_scale, scale, dtype):
    """fp8_matmul.tc_scaled: an FP8 tensor-core product times its scales, cast to dtype."""
    from pallas_kernels import fp8_matmul as fm
    return fm.tc_scaled(y, x_scale, scale, dtype)


def fp8_tc_product(x, kernel, dtype):
    """x quantized per token (one Pallas kernel: norm_quant.quant_rows) and its unscaled FP8
    product: -> (product, x's scales); the product's epilogue is left to the caller
    (norm_quant's delta)."""
    from pallas_kernels import fp8_matmul as fm
    from pallas_kernels import norm_quant as nq
    x_q, x_scale = nq.quant_rows(x, interpret=not _on_gpu())
    return fm.tc_product(x_q, kernel, dtype), x_scale


def fp8_mlp_quantized(x_q, x_scale, gateup, down, dtype):
    """The fused FP8 MLP (swiglu_quant.fp8_mlp_quantized) from quantized activations."""
    from pallas_kernels import swiglu_quant as sq
    (wgu, sgu), (wd, sd) = gateup, down
    return sq.fp8_mlp_quantized(x_q, x_scale, wgu, sgu, wd, sd, dtype, interpret=not _on_gpu())


def _fp8_linear(x, kernel, scale):
    from pallas_kernels.fp8_matmul import fp8_linear, fp8_linear_reference
    fn = fp8_linear if _on_gpu() else fp8_linear_reference
    return fn(x, kernel, scale)


def _fp8_sharded(x, kernel, scale, layout: TPLayout, kind: str):
    """kernel [out, in] e4m3, scale [out]. Column-parallel: each device computes its own
    output channels. Row-parallel: each device's slice of `in` gives a partial [M, out] (the
    per-channel scale distributes over the sum), all-reduced here."""
    if kind == "col":
        specs, out = (P(), P(AXIS, None), P(AXIS)), P(None, AXIS)
        body = _fp8_linear
    else:
        specs, out = (P(None, AXIS), P(None, AXIS), P()), P()

        def body(x, k, s):
            y = _fp8_linear(x, k, s).astype(jnp.float32)
            return jax.lax.psum(y, AXIS).astype(x.dtype)
    return jax.shard_map(body, mesh=layout.mesh, in_specs=specs, out_specs=out,
                         check_vma=False)(x, kernel, scale)
