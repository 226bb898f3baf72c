"""The one switch between Pallas kernels and their plain-jnp references.

`impl` is static ("reference" | "pallas"; EngineConfig's "auto" is resolved by
`resolve_attention_impl` before tracing): changing it means a different compiled step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.kv_cache import FP8_DTYPE, AttentionMetadata, KVCache


def resolve_attention_impl(impl: str) -> str:
    if impl != "auto":
        return impl
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def attention(q, kv: KVCache, layer, md: AttentionMetadata, *, sm_scale: float, impl: str):
    """q [T, H, D] over the paged cache (the new tokens' K/V already written) -> [T, H, D]."""
    from pallas_kernels import paged_attention as pa
    from pallas_kernels import ragged_paged_attention as rpa

    # "pallas" off the GPU runs the kernels in interpret mode (tests).
    interpret = jax.default_backend() != "gpu"
    if md.decode_only:
        fn = pa.paged_attention if impl == "pallas" else pa.paged_attention_reference
        return fn(q, kv.k, kv.v, layer, md.seq_lens, md.page_table, kv.k_scale, kv.v_scale,
                  sm_scale=sm_scale, interpret=interpret)
    fn = rpa.ragged_paged_attention if impl == "pallas" else rpa.ragged_paged_attention_reference
    return fn(q, kv.k, kv.v, layer, md, kv.k_scale, kv.v_scale, sm_scale=sm_scale,
              interpret=interpret)


def linear(x, kernel, scale=None, bias=None):
    """x [M, in] @ kernel -> [M, out]. FP8 kernels (with their per-channel `scale`) go to the
    FP8 matmul, which picks its own route by M; others are a plain dot XLA fuses around."""
    if kernel.dtype == FP8_DTYPE:
        from pallas_kernels.fp8_matmul import fp8_linear, fp8_linear_reference
        fn = fp8_linear if jax.default_backend() == "gpu" else fp8_linear_reference
        y = fn(x, kernel, scale)
    else:
        y = jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return y if bias is None else y + bias.astype(y.dtype)
