"""The Flax (NNX) decoder: Llama 2/3, Mistral, Qwen2 and SmolLM2 shapes over a paged KV cache.

Axis letters used in shape comments across jaxinfer (the one glossary):
    B batch rows (sequences), T new tokens in the step (flat over all rows), L layers,
    H q heads, K kv heads, D head dim, P pages, S page size, E hidden, F ffn, V vocab.

One forward takes a flat batch of new tokens — prefill chunks and single decode tokens
together — with AttentionMetadata, writes their K/V into the pages and attends over each
sequence's pages. Layers are stacked (every per-layer param has a leading L axis) and run
with `lax.scan`: one traced layer, so compile time does not grow with depth; the KV cache
rides in the scan carry and is updated in place (the step donates it). Unrolled
(Decoder(unroll_layers=True), the GPU default) each layer has its own weights and, in the
runner, its own KV arrays (kv_cache.KVLayers).

Linear weights are [in, out] (y = x @ w); q/k/v and gate/up are fused into single matmuls.
Under tensor parallelism (`layout`, see sharding.py) the fused outputs are laid out
shard-major — [n shards, (own q, k, v heads)] and [n, (own gate, up)] — and split after a
reshape to [T, n, ...], so each device keeps its own heads and GSPMD moves nothing; n=1 is
the plain [q | k | v] and [gate | up] layout.

Which kernel runs each part (attention, the fused decode front, the FP8 routes) is the
static `Routes` (routes.py) the runner hands to every call; ops.py applies it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import lora_layers, ops
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.kv_cache import AttentionMetadata, KVCache, KVLayers, pad_decode_rows
from jaxinfer.routes import Routes
from jaxinfer.sharding import TPLayout
from pallas_kernels import FP8_DTYPE
from pallas_kernels.rope import apply_rope


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, stack: tuple[int, ...] = (), dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones(stack + (dim,), dtype))  # [..., E]
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        return (xf * self.factor(xf) * self.weight[...].astype(jnp.float32)).astype(x.dtype)

    def factor(self, x):
        """Each row's 1 / sqrt(mean(x^2) + eps) [..., 1] f32: the norm without its weight."""
        xf = x.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)

    def weighted(self, x):
        """x times the weight, in x's dtype: the norm's rows before their factor (a scalar
        per row, which commutes with a following matmul: the folded norms)."""
        return (x.astype(jnp.float32) * self.weight[...].astype(jnp.float32)).astype(x.dtype)

    def add_norm(self, x, delta):
        """(x + delta, its norm); delta None: (x, its norm). XLA fuses the add and the norm."""
        x = x if delta is None else x + delta
        return x, self(x)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). `kernel` is [in, out] in the compute dtype, or with fp8=True
    e4m3 [out, in] (checkpoints.fp8.quantize_linear's layout) with a per-channel `scale`;
    with int8=True int8 [out, in] with a per-channel `scale` (the LM head's form: the
    decoder calls ops.int8_head on it). parallel: (layout, "col" | "row") when the kernel is
    sharded (FP8 runs per shard)."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs, stack=(), bias=False,
                 dtype=jnp.float32, fp8=False, parallel=None, int8=False):
        self.parallel = parallel
        if fp8 or int8:
            self.kernel = nnx.Param(jnp.zeros(stack + (dout, din), FP8_DTYPE if fp8 else jnp.int8))
            self.scale = nnx.Param(jnp.ones(stack + (dout,), jnp.float32))
        else:
            self.kernel = nnx.Param(_normal(rngs, stack + (din, dout), dtype))
            self.scale = None
        self.bias = nnx.Param(jnp.zeros(stack + (dout,), dtype)) if bias else None

    def __call__(self, x, routes: Routes, add_bias: bool = True):
        """add_bias=False: the product alone (a caller that adds self.bias itself)."""
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None or not add_bias else self.bias[...]
        return ops.linear(x, self.kernel[...], scale, bias, routes, parallel=self.parallel)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """HF-compatible inverse frequencies [D/2], with Llama-3 frequency-dependent scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * np.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def _parallel(layout: TPLayout, shards: int, kind: str):
    return (layout, kind) if shards > 1 else None


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, stack=(), dtype=jnp.float32, fp8=False,
                 layout: TPLayout = TPLayout()):
        self.cfg, self.layout = cfg, layout
        n = layout.attn
        self.wqkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, rngs=rngs, stack=stack,
                           bias=cfg.qkv_bias, dtype=dtype, fp8=fp8,
                           parallel=_parallel(layout, n, "col"))
        self.wo = Linear(cfg.q_size, cfg.hidden_size, rngs=rngs, stack=stack, dtype=dtype,
                         fp8=fp8, parallel=_parallel(layout, n, "row"))

    def __call__(self, x, kv: KVCache, layer, md: AttentionMetadata, cos, sin, routes: Routes,
                 norm: RMSNorm | None = None, lora=None):
        """x [T, E] normed; with `norm`, the residual rows that norm is still to be applied to
        (folded into the fused front, ops.front_norm_applies). lora: this layer's
        lora_layers.StepLoRA or None; where the fused front projects inside the attention
        kernel, QKV's update joins its partial products (lora_layers.add_to_partials)."""
        cfg, w = self.cfg, self.wqkv
        bias = None if w.bias is None else w.bias[...]
        scale = None if w.scale is None else w.scale[...]
        widths = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        update = None if lora is None else functools.partial(
            lora_layers.add_to_partials, lora=lora, group="qkv", widths=widths, scale=scale,
            routes=routes)
        fused = ops.decode_qkv_attention(
            x if norm is None else norm.weighted(x), w.kernel[...], scale, bias, kv, layer, md,
            cos, sin, num_heads=cfg.num_heads, sm_scale=cfg.head_dim ** -0.5, routes=routes,
            layout=self.layout, norm=None if norm is None else (x, norm.eps), update=update)
        if fused is not None:     # small decode steps: QKV's sum and RoPE in the attention
            o, kv = fused
            o = o.reshape(x.shape[0], cfg.q_size)
        else:
            if norm is not None:
                x = norm(x)
            # the QKV bias is added by attend: inside the RoPE + K/V write kernel where that
            # runs
            qkv = self.wqkv(x, routes, add_bias=False)
            if lora is not None:
                qkv = lora_layers.add_update(qkv, x, lora, "qkv", widths, routes)
            o, kv = self.attend(qkv, kv, layer, md, cos, sin, routes, bias=bias)
        out = self.wo(o, routes)
        if lora is not None:
            out = lora_layers.add_update(out, o, lora, "o", (cfg.hidden_size,), routes)
        return out, kv

    def attend(self, qkv, kv: KVCache, layer, md: AttentionMetadata, cos, sin, routes: Routes,
               bias=None, scales=None):
        """qkv [T, (H+2K)D] (the fused projection's output, without `bias` [(H+2K)D] if
        that is given, and unscaled if `scales` (x_scale [T, 1], w_scale [(H+2K)D]) are:
        the FP8 tensor-core product; both are applied here, in the RoPE kernel where that
        runs) -> the attention output [T, H*D] before wo, and the cache with the new
        tokens' K/V written."""
        cfg, n = self.cfg, self.layout.attn
        t = qkv.shape[0]
        fused = ops.rope_write_kv(kv, layer, qkv, cos, sin, md.slot_mapping,
                                  num_heads=cfg.num_heads, routes=routes, layout=self.layout,
                                  bias=bias, scales=scales)
        if fused is not None:
            q, kv = fused
        else:     # [T, n, (H+2K)D/n]: each device's own heads under tensor parallelism
            if scales is not None:
                qkv = ops.tc_scaled(qkv, *scales, qkv.dtype)
            qkv = ops.with_bias(qkv, bias)
            q, kv = self._rope_write(qkv.reshape(t, n, -1), kv, layer, md, cos, sin, routes)
        o = ops.attention(q, kv, layer, md, sm_scale=cfg.head_dim ** -0.5, routes=routes,
                          layout=self.layout)
        return o.reshape(t, cfg.q_size), kv

    def _rope_write(self, qkv, kv: KVCache, layer, md: AttentionMetadata, cos, sin,
                    routes: Routes):
        """qkv [T, n, (H+2K)D/n] -> (q [T, H, D] rotated, the cache with k and v written)."""
        cfg, n = self.cfg, self.layout.attn
        t = qkv.shape[0]
        hq, hk = cfg.q_size // n, cfg.kv_size // n
        q, k, v = jnp.split(qkv, [hq, hq + hk], axis=-1)
        q = apply_rope(q.reshape(t, cfg.num_heads, cfg.head_dim), cos, sin)     # [T, H, D]
        k = apply_rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)  # [T, K, D]
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)                        # [T, K, D]
        return q, ops.write_kv(kv, layer, k, v, md.slot_mapping, routes, layout=self.layout)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, stack=(), dtype=jnp.float32, fp8=False,
                 layout: TPLayout = TPLayout()):
        self.shards = m = layout.mlp
        self.w_gateup = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, rngs=rngs,
                               stack=stack, dtype=dtype, fp8=fp8,
                               parallel=_parallel(layout, m, "col"))
        self.w_down = Linear(cfg.intermediate_size, cfg.hidden_size, rngs=rngs, stack=stack,
                             dtype=dtype, fp8=fp8, parallel=_parallel(layout, m, "row"))

    def __call__(self, x, routes: Routes, lora=None):
        """x [T, E] normed -> [T, E]. lora: as Attention's (the fused FP8 MLP does not run
        with it)."""
        t = x.shape[0]
        if lora is None and self.shards == 1 and self.w_gateup.scale is not None:
            fused = ops.fused_fp8_mlp(x, (self.w_gateup.kernel[...], self.w_gateup.scale[...]),
                                      (self.w_down.kernel[...], self.w_down.scale[...]), routes)
            if fused is not None:
                return fused
        gu = self.w_gateup(x, routes)
        if lora is not None:
            gu = lora_layers.add_update(gu, x, lora, "gateup", (gu.shape[1] // 2,) * 2, routes)
        gu = gu.reshape(t, self.shards, 2, -1)                          # [T, m, 2, F/m]
        gate, up = gu[:, :, 0].reshape(t, -1), gu[:, :, 1].reshape(t, -1)  # [T, F] each
        h = jax.nn.silu(gate) * up
        y = self.w_down(h, routes)
        if lora is not None:
            y = lora_layers.add_update(y, h, lora, "down", (y.shape[1],), routes)
        return y


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs, stack=(), dtype=jnp.float32, fp8=False,
                 layout: TPLayout = TPLayout()):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.attn = Attention(cfg, rngs=rngs, stack=stack, dtype=dtype, fp8=fp8, layout=layout)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack, dtype=dtype)
        self.mlp = MLP(cfg, rngs=rngs, stack=stack, dtype=dtype, fp8=fp8, layout=layout)

    def __call__(self, x, delta, kv, layer, md, cos, sin, routes: Routes, lora=None):
        """The residual stream x [T, E] with delta still to be added to it (the previous
        layer's MLP output; None for the first layer) -> (x, this layer's MLP output still to
        be added, the cache). Unrolled, the add is left to the next RMSNorm (the decoder's
        final one after the last layer), which XLA fuses with it; the scan passes None and
        adds it in its body. Where the fused decode front applies (ops.front_norm_applies)
        the first RMSNorm is folded into it instead. lora: Attention's (the fused FP8 layer
        does not run with it; the fused front does)."""
        layout = self.attn.layout
        if lora is None and ops.fused_fp8_layer(x, self.attn.wqkv.kernel[...], self.mlp.w_down.kernel[...],
                               layout.size, routes):
            return self._fused_fp8(x if delta is None else x + delta, kv, layer, md, cos, sin,
                                   routes)
        if ops.front_norm_applies(x, kv, md, routes, layout):
            x = x if delta is None else x + delta
            h, kv = self.attn(x, kv, layer, md, cos, sin, routes, norm=self.attn_norm,
                              lora=lora)
        else:
            x, n = self.attn_norm.add_norm(x, delta)
            h, kv = self.attn(n, kv, layer, md, cos, sin, routes, lora=lora)
        x, n = self.mlp_norm.add_norm(x, h)
        return x, self.mlp(n, routes, lora), kv

    def _fused_fp8(self, x, kv, layer, md, cos, sin, routes: Routes):
        """__call__'s math on the FP8 tensor-core route (ops.fused_fp8_layer) with each
        RMSNorm fused into the quantization of its output, and the attention's residual add
        (with wo's product scales) into the MLP side's: pallas_kernels/norm_quant.py."""
        a, m = self.attn, self.mlp
        _, xq, xs = ops.norm_quant(x, self.attn_norm.weight[...], eps=self.attn_norm.eps,
                                   routes=routes)
        bias = None if a.wqkv.bias is None else a.wqkv.bias[...]
        # QKV's scales (and bias) are applied in the RoPE + K/V write kernel, not in an XLA
        # fusion of their own, which would read and write the whole product once more
        qkv = ops.fp8_tc_product_q(xq, a.wqkv.kernel[...], x.dtype)
        o, kv = a.attend(qkv, kv, layer, md, cos, sin, routes, bias=bias,
                         scales=(xs, a.wqkv.scale[...]))
        o_product, o_scale = ops.fp8_tc_product(o, a.wo.kernel[...], x.dtype, routes)
        x, xq, xs = ops.norm_quant(x, self.mlp_norm.weight[...],
                                   (o_product, o_scale, a.wo.scale[...]), eps=self.mlp_norm.eps,
                                   routes=routes)
        y = ops.fp8_mlp_quantized(xq, xs, (m.w_gateup.kernel[...], m.w_gateup.scale[...]),
                                  (m.w_down.kernel[...], m.w_down.scale[...]), x.dtype, routes)
        return x, y, kv


@functools.partial(jax.jit, static_argnums=(0, 1))
def _unrolled_layer(graphdef, routes, state, x, delta, kv, layer, md, cos, sin, lora):
    """One decoder layer of the unrolled model as its own (inner) jit: every layer has the
    same structure and shapes, so tracing it once serves all of them (tracing the whole
    step layer by layer cost seconds per executable at start-up). XLA inlines the call: the
    compiled step has the same kernels as without it."""
    return nnx.merge(graphdef, state)(x, delta, kv, layer, md, cos, sin, routes, lora)


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, fp8=False,
                 unroll_layers=False, layout: TPLayout = TPLayout(), int8_head=False,
                 dense_head_above: int | None = None):
        """fp8: decoder-layer linears hold FP8 weights (embeddings, norms, LM head stay).
        int8_head: the LM head as int8 codes [V, E] with per-vocab-row scales (its own
        weight even where the embeddings are tied; ops.int8_head). dense_head_above (with
        int8_head): also those codes dequantized (lm_head_dense [V, E] in dtype), which
        logits reads for more rows than this (EngineConfig.lm_head "auto").
        unroll_layers: one weight buffer per layer and a Python loop over layers instead of
        stacked weights under lax.scan. The scan dynamic-slices each layer's weights out of
        the stacked arrays, which XLA materializes as per-layer copies (docs/performance.md);
        per-layer buffers are read in place. Costs longer compiles.
        layout: the tensor-parallel split (sharding.py); the weights' placement must match."""
        self.cfg = cfg
        self.unroll_layers, self.layout = unroll_layers, layout
        self.embed = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))  # [V, E]
        if unroll_layers:
            self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, dtype=dtype, fp8=fp8,
                                                 layout=layout) for _ in range(cfg.num_layers)])
        else:
            self.layers = DecoderLayer(cfg, rngs=rngs, stack=(cfg.num_layers,), dtype=dtype,
                                       fp8=fp8, layout=layout)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.dense_head_above = dense_head_above if int8_head else None
        if int8_head:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, int8=True)
            if dense_head_above is not None:
                self.lm_head_dense = nnx.Param(
                    _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        else:
            self.lm_head = None if cfg.tie_word_embeddings else Linear(
                cfg.hidden_size, cfg.vocab_size, rngs=rngs, dtype=dtype)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))  # [D/2], not a param

    def __call__(self, tokens, kv: KVCache | KVLayers, md: AttentionMetadata,
                 routes: Routes = Routes(), lora=None, num_layers: int | None = None):
        """tokens [T] -> final hidden states [T, E] (normed) and the updated cache: scanned,
        one KVCache of all layers; unrolled, that or KVLayers (kv_cache.py; the runner's
        pool). A decode step of fewer rows than ops.decode_rows asks for runs padded to that
        (GPU: one pad here instead of a pad and a slice around every small linear).
        lora: (the adapters' weights in lora_layers.allocate's form, each token's slot [T]
        i32, -1 for none) or None: no LoRA work in the step. num_layers (static): run only
        the first that many layers, then the final norm (self-speculation's draft: an early
        exit; the cache's other layers are left alone)."""
        n = self.cfg.num_layers if num_layers is None else num_layers
        t = tokens.shape[0]
        rows = ops.decode_rows(t, routes) if md.decode_only else t
        if rows > t:
            padded, md_padded = pad_decode_rows(tokens, md, rows)
            if lora is not None:
                lora = (lora[0], jnp.pad(lora[1], (0, rows - t), constant_values=-1))
            h, kv = self(padded, kv, md_padded, routes, lora, num_layers)
            return h[:t], kv
        x = self.embed[...][tokens]                                     # [T, E]
        weights, slots = (None, None) if lora is None else lora     # slots [T] i32
        if routes.lora_kernel and not (self.unroll_layers and self.layout.size == 1):
            # LoRA's kernels take each layer's own arrays, on one device
            routes = routes.replace(lora_kernel=False)
        freqs = md.positions.astype(jnp.float32)[:, None] * self.inv_freq[...][None, :]
        cos, sin = jnp.cos(freqs), jnp.sin(freqs)                        # [T, D/2]
        if self.unroll_layers:
            delta = None          # each layer's MLP output, added by the next RMSNorm
            if isinstance(kv, KVLayers) and len(kv.layers) != self.cfg.num_layers:
                raise ConfigError(f"a KV pool of {len(kv.layers)} layers for a model of "
                                  f"{self.cfg.num_layers}")
            for i in range(n):
                graphdef, state = nnx.split(self.layers[i])
                cache, index = kv.layer(i)      # KVLayers: layer i's own arrays, at index 0
                with jax.named_scope("decoder_layer"):  # bench/hlo.py counts kernels by it
                    x, delta, cache = _unrolled_layer(
                        graphdef, routes, state, x, delta, cache, jnp.int32(index), md, cos,
                        sin, None if weights is None else lora_layers.StepLoRA(weights[i],
                                                                               slots))
                kv = kv.with_layer(i, cache)
            return self.final_norm.add_norm(x, delta)[1], kv
        if isinstance(kv, KVLayers):
            raise ConfigError("the scanned decoder takes the pool as one KVCache of all layers "
                              "(kv_cache.allocate_kv), not KVLayers")
        graphdef, state = nnx.split(self.layers)
        if n < self.cfg.num_layers:
            state, weights = jax.tree.map(lambda a: a[:n], (state, weights))

        def body(carry, xs):     # the MLP's add stays in the layer's body (XLA fuses it)
            h, kv = carry
            layer_state, layer, layer_lora = xs
            h, delta, kv = nnx.merge(graphdef, layer_state)(
                h, None, kv, layer, md, cos, sin, routes,
                None if layer_lora is None else lora_layers.StepLoRA(layer_lora, slots))
            return (h + delta, kv), None

        layer_ids = jnp.arange(n, dtype=jnp.int32)
        (x, kv), _ = jax.lax.scan(body, (x, kv), (state, layer_ids, weights))
        return self.final_norm(x), kv

    def logits(self, h, routes: Routes = Routes()):
        """h [B, E] -> [B, V] f32. The int8 head with a dense copy: the copy for B over
        dense_head_above (B is static: the step's bucket)."""
        if self.lm_head is None:
            return jnp.dot(h, self.embed[...].T.astype(h.dtype),
                           preferred_element_type=jnp.float32)
        if self.dense_head_above is not None and h.shape[0] > self.dense_head_above:
            return jnp.dot(h, self.lm_head_dense[...].T.astype(h.dtype),
                           preferred_element_type=jnp.float32)
        if self.lm_head.kernel.dtype == jnp.int8:
            return ops.int8_head(h, self.lm_head.kernel[...], self.lm_head.scale[...], routes)
        return self.lm_head(h, routes).astype(jnp.float32)
