"""The model's kernels over the KV pool, lowered for CUDA on the CPU (Triton IR, nothing run):
over one layer's arrays of KVLayers they compute their load and store offsets in 32-bit
integers, over the stacked pool in 64-bit ones. Pallas's Triton lowering switches to 64-bit
offsets for arrays of >= 4 GiB (kv_cache.py), which the stacked pool is at the throughput
run's size and one layer's share is not; over such arrays the FP8 decode kernel runs ~7%
slower on the H200 (docs/performance.md). The calls go through jaxinfer.ops as the model
makes them, with the GPU's choices (the GPU's routes): the decode kernel, the
mixed step's ragged + decode kernels, and the RoPE + K/V write."""
import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from jaxinfer import ops
from jaxinfer.config import EngineConfig
from jaxinfer.kv_cache import AttentionMetadata, KVCache, KVLayers
from jaxinfer.routes import Routes
from pallas_kernels import FP8_DTYPE

# Llama-3-8B's attention shapes and pools of about the throughput run's size (64,001 pages;
# each test its own page count, so no trace cached without the debug output is reused)
LAYERS, HQ, HKV, D, PAGE = 32, 32, 8, 128, 16
ROWS, WIDTH = 64, 96                    # rows of the step, page-table width (1,536 tokens)
GPU = Routes.choose(EngineConfig(), "gpu")


def pools(pages: int):
    """(stacked KVCache, KVLayers) of FP8 KV as abstract arrays: no memory is allocated."""
    args = (HKV, pages, PAGE, D, FP8_DTYPE)
    return (jax.eval_shape(lambda: KVCache.allocate(LAYERS, *args)),
            jax.eval_shape(lambda: KVLayers.allocate(LAYERS, *args)))


def metadata(tokens: int, decode_only: bool) -> AttentionMetadata:
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    return AttentionMetadata(i32(tokens), i32(tokens), i32(tokens), i32(ROWS, WIDTH), i32(ROWS),
                             i32(ROWS + 1), decode_only=decode_only)


def triton_ir(monkeypatch, fn, *args) -> str:
    """The Triton IR of every Pallas call in fn(*args), lowered for CUDA (pallas_call's debug
    output)."""
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    text = out.getvalue()
    assert "tt.func" in text, "no Triton IR printed: did the Pallas debug output change?"
    return text


def i64_count(text: str) -> int:
    return len(re.findall(r"\bi64\b", text))


def attend(tokens: int, decode_only: bool):
    def fn(q, kv, md):
        return ops.attention(q, kv, jnp.int32(0), md, sm_scale=D ** -0.5, routes=GPU)
    q = jax.ShapeDtypeStruct((tokens, HQ, D), jnp.bfloat16)
    return fn, q, metadata(tokens, decode_only)


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_attention_kernels_use_32_bit_offsets_on_one_layer(monkeypatch, step):
    stacked, layered = pools(64001 if step == "decode" else 64002)
    assert stacked.k.size >= 2 ** 32 > layered.layers[0].k.size     # bytes: FP8
    fn, q, md = attend(ROWS, True) if step == "decode" else attend(2048, False)
    one_layer = triton_ir(monkeypatch, fn, q, layered.layers[31], md)
    whole = triton_ir(monkeypatch, fn, q, stacked, md)
    names = set(re.findall(r"tt\.func public @(\w+)", one_layer))
    want = {"decode": {"jaxinfer_paged_decode_pairs"},
            "mixed": {"jaxinfer_paged_decode_pairs", "jaxinfer_ragged_paged_attention"}}
    assert want[step] <= names, names
    assert i64_count(one_layer) == 0
    assert i64_count(whole) > 0


def test_kv_write_uses_32_bit_offsets_on_one_layer(monkeypatch):
    stacked, layered = pools(64003)
    t = 2048

    def fn(kv, qkv, cos, sin, slots):
        return ops.rope_write_kv(kv, jnp.int32(0), qkv, cos, sin, slots, num_heads=HQ,
                                 routes=GPU)
    args = (jax.ShapeDtypeStruct((t, (HQ + 2 * HKV) * D), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((t, D // 2), jnp.float32)] * 2,
            jax.ShapeDtypeStruct((t,), jnp.int32))
    one_layer = triton_ir(monkeypatch, fn, layered.layers[0], *args)
    assert "jaxinfer_rope_kv_write" in one_layer and i64_count(one_layer) == 0
    assert i64_count(triton_ir(monkeypatch, fn, stacked, *args)) > 0
