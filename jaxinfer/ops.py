"""The model's calls into the Pallas kernels and their plain-jnp references, by `Routes`.

Each function takes the step's `Routes` (routes.py: static, chosen when the engine is built)
and returns the kernel's result or, where the route does not apply (its conditions in the
docstring), the reference's — or None where the caller owns the unfused path.

Tensor parallelism (sharding.py): GSPMD cannot partition a Pallas kernel, so on a mesh the
kernels run under `shard_map`: attention on its device's kv heads (all of them when
attention is replicated), FP8 linears on their weight shard; a row-parallel one sums its
partial products across the mesh itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.kv_cache import AttentionMetadata, KVCache
from jaxinfer.routes import Routes
from jaxinfer.sharding import AXIS, TPLayout, kv_spec
from pallas_kernels import FP8_DTYPE, kv_pages
from pallas_kernels import decode_qkv as dq
from pallas_kernels import fp8_matmul as fm
from pallas_kernels import kv_write as kw
from pallas_kernels import norm_quant as nq
from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels import swiglu_quant as sq


def decode_rows(rows: int, routes: Routes) -> int:
    """The rows a decode step of `rows` rows runs with (model.Decoder pads it once)."""
    return max(rows, routes.decode_min_rows)


def write_kv(kv: KVCache, layer, k, v, slot_mapping, routes: Routes,
             layout: TPLayout = TPLayout()) -> KVCache:
    """The new tokens' K/V ([T, K, D]) into their pages: one kernel (kv_write.py) with Pallas
    attention on one device, else XLA's scatter (kv_pages.write_kv)."""
    if routes.pallas and layout.size == 1 and kw.supported(kv):
        return kw.write_kv(kv, layer, k, v, slot_mapping, interpret=routes.interpret)
    return kv_pages.write_kv(kv, layer, k, v, slot_mapping)


def rope_write_kv(kv: KVCache, layer, qkv, cos, sin, slot_mapping, *, num_heads: int,
                  routes: Routes, layout: TPLayout = TPLayout(), bias=None, scales=None):
    """RoPE on the fused QKV projection's output and the K/V write in one kernel: -> (q
    [T, H, D] rotated, the cache), or None where it does not apply (the caller splits,
    rotates and calls write_kv): no fused glue, tensor parallelism, or a head dim the kernel
    does not take. bias: the projection's bias, added in the kernel, or None; scales:
    (x_scale [T, 1], w_scale [(H+2K)D]) of an unscaled FP8 tensor-core product, or None."""
    if not (routes.fused_glue and layout.size == 1 and kw.supported(kv)):
        return None
    kv, q = kw.rope_write_kv(kv, layer, qkv, cos, sin, slot_mapping, num_heads=num_heads,
                             bias=bias, scales=scales, interpret=routes.interpret)
    return q, kv


def _front_blocks(x, kv: KVCache, md: AttentionMetadata, routes: Routes, layout: TPLayout):
    """The decode table's blocks the fused front reads this cache with, or None where the
    front does not apply: not a decode step of <= routes.front_max_rows rows, tensor
    parallelism, a hidden size qkv_parts does not divide, or a cache the kernel does not take."""
    t = x.shape[0]
    if not (routes.fused_glue and layout.size == 1 and md.decode_only
            and t <= routes.front_max_rows and x.shape[1] % routes.qkv_parts == 0):
        return None
    blocks = dq.table_blocks(kv, md.page_table, md.attend_rows or t)
    return blocks if dq.supported(kv, blocks) else None


def front_norm_applies(x, kv: KVCache, md: AttentionMetadata, routes: Routes,
                       layout: TPLayout = TPLayout()) -> bool:
    """Whether the RMSNorm before QKV folds into the fused front (decode_qkv_attention's
    `norm`): routes.front_norm and the front applies."""
    return routes.front_norm and _front_blocks(x, kv, md, routes, layout) is not None


def decode_qkv_attention(x, kernel, scale, bias, kv: KVCache, layer, md: AttentionMetadata,
                         cos, sin, *, num_heads: int, sm_scale: float, routes: Routes,
                         layout: TPLayout = TPLayout(), norm=None, update=None):
    """QKV's projection of x [T, E] (kernel and FP8 scale as the Linear holds them, bias or
    None), RoPE, the K/V write and decode attention, with the projection's split-K sum,
    scales, bias and RoPE inside the attention kernel (decode_qkv.py) -> (out [T, H, D], the
    cache); None where the front does not apply (_front_blocks). norm (rows [T, E], eps):
    the RMSNorm before QKV folded in: x is those rows times the norm's weight, and the kernel
    scales each row's sum by 1 / rms(rows). update: partials [S, T, N], x -> partials, what
    the kernel sums (a LoRA update added: lora_layers.add_to_partials), or None."""
    blocks = _front_blocks(x, kv, md, routes, layout)
    if blocks is None:
        return None
    t = x.shape[0]
    n = md.attend_rows or t
    rows, eps = (None, None) if norm is None else norm
    partials = dq.partial_products(x, kernel, routes.qkv_parts)
    if update is not None:
        partials = update(partials, x)
    return dq.paged_attention_qkv(partials, scale, bias,
                                  cos, sin, kv, layer, md.seq_lens, md.page_table,
                                  md.slot_mapping, num_heads=num_heads, sm_scale=sm_scale,
                                  dtype=x.dtype, interpret=routes.interpret,
                                  rows=n if n < t else None, longest_first=None,
                                  blocks=blocks, x=rows, norm_eps=eps)


def attention(q, kv: KVCache, layer, md: AttentionMetadata, *, sm_scale: float, routes: Routes,
              layout: TPLayout = TPLayout()):
    """q [T, H, D] over the paged cache (the new tokens' K/V already written) -> [T, H, D]."""
    if layout.size == 1:
        return _attention(q, kv, layer, md, sm_scale=sm_scale, routes=routes)
    heads = P(None, AXIS) if layout.attn > 1 else P()      # q/out [T, H, D] and the cache
    fn = jax.shard_map(lambda q, kv, layer, md: _attention(q, kv, layer, md, sm_scale=sm_scale,
                                                            routes=routes),
                       mesh=layout.mesh, in_specs=(heads, kv_spec(layout), P(), P()),
                       out_specs=heads, check_vma=False)
    return fn(q, kv, layer, md)


def _attention(q, kv: KVCache, layer, md: AttentionMetadata, *, sm_scale: float, routes: Routes):
    if md.decode_only:
        rows = q.shape[0]
        n = md.attend_rows or rows          # rows past n: padding (kv_cache.pad_decode_rows)
        if routes.pallas:                   # the kernel skips (and zeroes) the padding itself
            return pa.paged_attention(q, kv.k, kv.v, layer, md.seq_lens, md.page_table,
                                      kv.k_scale, kv.v_scale, sm_scale=sm_scale,
                                      interpret=routes.interpret, rows=n if n < rows else None,
                                      longest_first=None)
        o = pa.paged_attention_reference(q[:n], kv.k, kv.v, layer, md.seq_lens[:n],
                                         md.page_table[:n], kv.k_scale, kv.v_scale,
                                         sm_scale=sm_scale)
        return o if n == rows else jnp.pad(o, ((0, rows - n), (0, 0), (0, 0)))
    if routes.pallas:
        return rpa.ragged_paged_attention(q, kv.k, kv.v, layer, md, kv.k_scale, kv.v_scale,
                                          sm_scale=sm_scale, interpret=routes.interpret)
    return rpa.ragged_paged_attention_reference(q, kv.k, kv.v, layer, md, kv.k_scale,
                                                kv.v_scale, sm_scale=sm_scale)


def _pad_rows(x, routes: Routes):
    """x [M, ...] padded to routes.min_gemm_rows rows (the GPU's small-GEMM floor)."""
    pad = routes.min_gemm_rows - x.shape[0]
    return jnp.pad(x, ((0, pad), (0, 0))) if pad > 0 else x


def linear(x, kernel, scale, bias, routes: Routes, parallel=None):
    """x [M, in] @ kernel -> [M, out]. FP8 kernels (with their per-channel `scale`) go to the
    FP8 matmul, which picks its own route by M; others are a plain dot XLA fuses around (and
    GSPMD partitions), M padded to routes.min_gemm_rows. parallel: (layout, "col" | "row")
    for a sharded kernel."""
    if kernel.dtype == FP8_DTYPE:
        y = (_fp8_linear(x, kernel, scale, routes) if parallel is None
             else _fp8_sharded(x, kernel, scale, routes, *parallel))
    else:
        y = jnp.dot(_pad_rows(x, routes), kernel.astype(x.dtype),
                    preferred_element_type=jnp.float32)
        y = y[:x.shape[0]].astype(x.dtype)
    return with_bias(y, bias)


def int8_head(x, codes, scale, routes: Routes):
    """x [M, E] @ an int8 LM head (codes [V, E], per-vocab-row scale [V]) -> f32 logits
    [M, V]: the codes widened to x's dtype in the GEMM's operand (XLA fuses the convert),
    the scale applied to the f32 product; M padded as linear pads it. Half the bf16 head's
    bytes; compute-bound above ~64 rows, where the bf16 head is faster."""
    y = jax.lax.dot_general(_pad_rows(x, routes), codes.astype(x.dtype),
                            (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y[:x.shape[0]] * scale[None, :].astype(jnp.float32)


def with_bias(y, bias):
    """y + bias in y's dtype (bias None: y): how a Linear's bias is added."""
    return y if bias is None else y + bias.astype(y.dtype)


def fused_fp8_mlp(x, gateup, down, routes: Routes):
    """The FP8 MLP with SiLU * up and the down projection's quantization in one kernel
    (swiglu_quant.py), or None where it does not apply (_fp8_mlp_applies). gateup/down:
    (kernel, scale) of the unsharded FP8 linears."""
    (wgu, sgu), (wd, sd) = gateup, down
    if not _fp8_mlp_applies(x, wgu, wd, routes):
        return None
    return sq.fp8_mlp(x, wgu, sgu, wd, sd, interpret=routes.interpret)


def _fp8_mlp_applies(x, w_first, w_down, routes: Routes) -> bool:
    """routes.fp8_mlp, FP8 weights (w_first: the layer's first FP8 linear), M above the
    fused-dequant route's rows (fp8_matmul.DEQUANT_MAX_M) and an F swiglu_quant takes."""
    return (routes.fp8_mlp and w_first.dtype == FP8_DTYPE and x.shape[0] > fm.DEQUANT_MAX_M
            and sq.supported(w_down.shape[-1]))


def fused_fp8_layer(x, wqkv, w_down, shards: int, routes: Routes) -> bool:
    """Whether a decoder layer runs its FP8 tensor-core route with the RMSNorms fused into
    the quantizations (norm_quant, fp8_tc_product_q, fp8_mlp_quantized; model.DecoderLayer):
    routes.fp8_norm_quant, one device, and the fused FP8 MLP's conditions."""
    return (routes.fp8_norm_quant and shards == 1 and _fp8_mlp_applies(x, wqkv, w_down, routes)
            and nq.supported(x.shape[1]))


def norm_quant(x, weight, delta=None, *, eps: float, routes: Routes):
    """RMSNorm(x + delta) quantized per token to e4m3 (norm_quant.py):
    -> (x after the add or None, codes [M, E], scales [M, 1])."""
    return nq.norm_quant(x, weight, delta, eps=eps, interpret=routes.interpret)


def fp8_tc_product_q(x_q, kernel, dtype):
    """The unscaled FP8 tensor-core product of activations already quantized per token; its
    scales are left to the consumer (tc_scaled's epilogue; the RoPE kernel takes them)."""
    return fm.tc_product(x_q, kernel, dtype)


def tc_scaled(y, x_scale, scale, dtype):
    """fp8_matmul.tc_scaled: an FP8 tensor-core product times its scales, cast to dtype."""
    return fm.tc_scaled(y, x_scale, scale, dtype)


def fp8_tc_product(x, kernel, dtype, routes: Routes):
    """x quantized per token (norm_quant.quant_rows, one kernel) and its unscaled FP8
    product: -> (product, x's scales); the product's epilogue is left to the caller."""
    x_q, x_scale = nq.quant_rows(x, interpret=routes.interpret)
    return fm.tc_product(x_q, kernel, dtype), x_scale


def fp8_mlp_quantized(x_q, x_scale, gateup, down, dtype, routes: Routes):
    """The fused FP8 MLP (swiglu_quant.fp8_mlp_quantized) from quantized activations."""
    (wgu, sgu), (wd, sd) = gateup, down
    return sq.fp8_mlp_quantized(x_q, x_scale, wgu, sgu, wd, sd, dtype,
                                interpret=routes.interpret)


def _fp8_linear(x, kernel, scale, routes: Routes):
    fn = fm.fp8_linear_reference if routes.interpret else fm.fp8_linear
    return fn(x, kernel, scale)


def _fp8_sharded(x, kernel, scale, routes: Routes, layout: TPLayout, kind: str):
    """kernel [out, in] e4m3, scale [out]. Column-parallel: each device computes its own
    output channels. Row-parallel: each device's slice of `in` gives a partial [M, out] (the
    per-channel scale distributes over the sum), all-reduced here."""
    if kind == "col":
        specs, out = (P(), P(AXIS, None), P(AXIS)), P(None, AXIS)

        def body(x, k, s):
            return _fp8_linear(x, k, s, routes)
    else:
        specs, out = (P(None, AXIS), P(None, AXIS), P()), P()

        def body(x, k, s):
            y = _fp8_linear(x, k, s, routes).astype(jnp.float32)
            return jax.lax.psum(y, AXIS).astype(x.dtype)
    return jax.shard_map(body, mesh=layout.mesh, in_specs=specs, out_specs=out,
                         check_vma=False)(x, kernel, scale)
