"""The decoder layer's fused glue (the RoPE + K/V write kernel, the fused decode front with its
folded RMSNorm) against the unfused route, on a tiny random model."""
import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dense_reference import random_flat
from jaxinfer.config import EngineConfig, standard_config
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.kv_cache import single_sequence_metadata as single_sequence_md
from checkpoints.model_state import build_model
from jaxinfer.routes import Routes
from jaxinfer.runner import ModelRunner

# Pallas attention in interpret mode with the GPU's decode padding, no fused glue
UNFUSED = Routes(attention="pallas", interpret=True, decode_min_rows=8)


def kernels(jaxpr):
    """The names of the step's Pallas calls (nested jits searched)."""
    names = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    for e in jaxpr.eqns:
        names += [n for sub in jax.extend.core.jaxprs_in_params(e.params) for n in kernels(sub)]
    return names


def xla_count(jaxpr, primitive: str) -> int:
    """How often `primitive` runs outside the Pallas calls (nested jits searched)."""
    n = sum(e.primitive.name == primitive for e in jaxpr.eqns)
    return n + sum(xla_count(sub, primitive) for e in jaxpr.eqns if e.primitive.name != "pallas_call"
                   for sub in jax.extend.core.jaxprs_in_params(e.params))


@pytest.mark.parametrize("unroll,bias", [(False, False), (True, False), (True, True)])
def test_fused_glue_equals_unfused(unroll, bias):
    """The fused glue (RoPE + K/V write in one kernel) and the fused decode front (the decode
    step's QKV sum, RoPE and K/V write inside the decode kernel, with and without the RMSNorm
    before QKV folded in) against the unfused route, with Pallas attention in interpret mode:
    a prefill and a decode step padded to 8 rows give the same logits and the same cache, and
    the decode step's jaxpr holds each route's kernels. (The tiny context is not split: the
    combine kernel has its own tests in test_paged_attention_outputs.py.) With a QKV bias
    (Qwen2) the fused routes add it in their kernels, the unfused one in the projection."""
    cfg = dataclasses.replace(standard_config("tiny"), qkv_bias=bias)
    flat = random_flat(cfg, seed=8)
    engine = EngineConfig(page_size=4, max_model_len=32, max_num_seqs=2,
                          attention_impl="pallas")
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, cfg.vocab_size, 7).astype(np.int32)
    ids = [2, 4]
    decode_md = AttentionMetadata(
        positions=jnp.asarray([7], jnp.int32), slot_mapping=jnp.asarray([4 * 4 + 3], jnp.int32),
        token_seq=jnp.zeros(1, jnp.int32), page_table=jnp.asarray([[2, 4, 0, 0, 0, 0, 0, 0]]),
        seq_lens=jnp.asarray([8], jnp.int32), query_start=jnp.asarray([0, 1], jnp.int32),
        decode_only=True)

    def run(routes):
        runner = ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32,
                                                       unroll_layers=unroll), routes)
        pre = runner.all_logits(prompt, single_sequence_md(range(7), ids, 4,
                                                          engine.pages_per_seq))
        nxt = jnp.asarray([int(np.argmax(pre[-1]))], jnp.int32)
        jaxpr = jax.make_jaxpr(lambda kv: runner._logits_fn(
            runner.params, kv, nxt, decode_md))(runner.kv).jaxpr
        dec = runner.all_logits(np.asarray(nxt), decode_md)
        kv = runner.kv.stacked()
        return pre, dec, np.asarray(kv.k), np.asarray(kv.v), kernels(jaxpr), xla_count(
            jaxpr, "rsqrt")

    glue = UNFUSED.replace(fused_glue=True)
    front = glue.replace(front_max_rows=8)
    pre_u, dec_u, k_u, v_u, names_u, norms_u = run(UNFUSED)
    pre_f, dec_f, k_f, v_f, names_f, norms_f = run(glue)
    pre_q, dec_q, k_q, v_q, names_q, norms_q = run(front)
    unfolded = [run(front.replace(front_norm=False))] if unroll and not bias else []
    for pre, dec, k, v in [(pre_f, dec_f, k_f, v_f), (pre_q, dec_q, k_q, v_q)] + [
            r[:4] for r in unfolded]:
        np.testing.assert_allclose(pre, pre_u, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(dec, dec_u, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(k, k_u, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(v, v_u, atol=1e-5, rtol=1e-5)
    assert np.abs(k_f).sum() > 0
    # the scan traces one layer; unrolled, the first layer (nothing to add) and the rest
    # are the inner jit's two traces
    layers = 1 if not unroll else 2
    assert names_f.count("jaxinfer_rope_kv_write") == layers
    assert "jaxinfer_kv_write" not in names_f
    assert names_u.count("jaxinfer_kv_write") == layers
    assert "jaxinfer_rope_kv_write" not in names_u
    # the decode front: neither write kernel, the decode kernel's fused form in each layer
    assert names_q.count("jaxinfer_paged_decode_qkv") == layers
    assert not {"jaxinfer_rope_kv_write", "jaxinfer_kv_write"} & set(names_q)
    assert "jaxinfer_paged_decode_qkv" not in names_f + names_u
    # RMSNorms left to XLA: two per layer and the final one; the front folds the first
    assert norms_u == norms_f == 2 * layers + 1
    assert norms_q == layers + 1
    if unfolded:
        assert unfolded[0][5] == 2 * layers + 1


@pytest.mark.gpu
@pytest.mark.parametrize("unroll", [False, True])
def test_gpu_fused_glue_equals_unfused(unroll):
    """On the GPU, compiled: the fused glue and decode front (the GPU's routes) against the
    unfused route on the tiny model in f32 (Pallas attention, a decode step of one row padded
    to 8): a prefill and four decode steps give the same logits and the same cache."""
    assert jax.default_backend() == "gpu"
    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=12)
    engine = EngineConfig(page_size=4, max_model_len=32, max_num_seqs=2,
                          attention_impl="pallas")
    prompt = np.random.default_rng(13).integers(0, cfg.vocab_size, 9).astype(np.int32)
    ids = [3, 1, 5, 2]

    routes = Routes.choose(engine, "gpu")

    def run(fused):
        runner = ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32,
                                                       unroll_layers=unroll),
                             routes if fused else routes.replace(fused_glue=False))
        out = [runner.all_logits(prompt, single_sequence_md(range(9), ids, 4,
                                                             engine.pages_per_seq))]
        tok = int(np.argmax(out[-1][-1]))
        for pos in range(9, 13):
            out.append(runner.all_logits(np.asarray([tok], np.int32), single_sequence_md(
                [pos], ids, 4, engine.pages_per_seq)))
            tok = int(np.argmax(out[-1][-1]))
        kv = runner.kv.stacked()
        return np.concatenate(out), np.asarray(kv.k), np.asarray(kv.v)

    logits_u, k_u, v_u = run(False)
    logits_f, k_f, v_f = run(True)
    # f32 dots run as TF32 on the GPU (10-bit mantissa): q differing in its last f32 bit
    # between the routes moves a logit by up to ~1e-3 relative. The decode steps' K/V come
    # from QKV's partial products (ops.decode_qkv_attention), a GEMM of its own under TF32
    # (~3e-4 abs from the unfused route's, on values of ~0.02-1); the prefill's slots
    # (positions 0-8) are written alike
    np.testing.assert_allclose(logits_f, logits_u, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(k_f, k_u, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(v_f, v_u, atol=2e-3, rtol=2e-3)
    pages, slots = zip(*[(ids[p // 4], p % 4) for p in range(9)])
    for f, u in ((k_f, k_u), (v_f, v_u)):
        np.testing.assert_allclose(f[:, :, pages, slots], u[:, :, pages, slots], atol=1e-5,
                                   rtol=1e-5)
    assert np.abs(k_f[:, :, ids[3], 0]).sum() > 0       # position 12, the last decode step
    assert np.array_equal(np.argmax(logits_f, -1), np.argmax(logits_u, -1))
