"""The paged decoder against an independent dense forward, on a tiny random model."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dense_reference import dense_logits, random_flat
from jaxinfer.config import EngineConfig, RopeScaling, standard_config
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.kv_cache import single_sequence_metadata as single_sequence_md
from checkpoints.model_state import build_model
from jaxinfer.routes import Routes
from jaxinfer.runner import ModelRunner


def paged_logits(cfg, flat, tokens, prefill_len, page_size=4):
    """Prefill tokens[:prefill_len] in one step, then feed the rest one token per step.
    Pages are handed out in a scrambled order so the page table really matters."""
    engine = EngineConfig(page_size=page_size, max_model_len=64, max_num_seqs=2)
    graphdef, params = build_model(cfg, flat, jnp.float32)
    runner = ModelRunner(cfg, engine, graphdef, params)
    n_pages = -(-len(tokens) // page_size)
    page_ids = list(np.random.default_rng(1).permutation(np.arange(1, engine.total_pages))
                    [:n_pages])
    out = [runner.all_logits(tokens[:prefill_len], single_sequence_md(
        range(prefill_len), page_ids, page_size, engine.pages_per_seq))]
    for pos in range(prefill_len, len(tokens)):
        out.append(runner.all_logits(tokens[pos:pos + 1], single_sequence_md(
            [pos], page_ids, page_size, engine.pages_per_seq)))
    return np.concatenate(out)


@pytest.mark.parametrize("variant", ["llama", "qwen2-bias", "llama3-rope", "tied"])
def test_prefill_then_decode_equals_dense_forward(variant):
    cfg = standard_config("tiny")
    cfg = {
        "llama": cfg,
        "qwen2-bias": dataclasses.replace(cfg, architecture="qwen2", qkv_bias=True),
        "llama3-rope": dataclasses.replace(cfg, rope_theta=500000.0, rope_scaling=RopeScaling(
            8.0, 1.0, 4.0, 16)),
        "tied": dataclasses.replace(cfg, tie_word_embeddings=True),
    }[variant]
    flat = random_flat(cfg, seed=3)
    if cfg.tie_word_embeddings:
        flat.pop("lm_head", None)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 19).astype(np.int32)
    ref = dense_logits(cfg, flat, tokens)
    got = paged_logits(cfg, flat, tokens, prefill_len=7)
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=1e-3)


def test_fp8_weights_close_to_float():
    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=5)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 9).astype(np.int32)
    ref = dense_logits(cfg, flat, tokens)
    graphdef, params = build_model(cfg, flat, jnp.float32, fp8=True)
    runner = ModelRunner(cfg, EngineConfig(page_size=4, max_model_len=32, max_num_seqs=1),
                         graphdef, params)
    got = runner.all_logits(tokens, single_sequence_md(range(9), [1, 2, 3], 4, 8))
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # e4m3 keeps 3 mantissa bits: ~2-3% relative error per weight, averaging down in dots.
    assert err < 0.08, err
    assert err > 1e-6, "FP8 path returned the float result: weights were not quantized"


def test_unrolled_layers_equal_scanned(monkeypatch):
    """The scanned decoder over one KVCache of all layers, the unrolled one over its
    per-layer KVLayers (the runner's pools) and over a stacked KVCache (index i): the same
    logits and the same cache contents. The pools' forms are checked too."""
    import jax
    from jaxinfer import runner as runner_mod
    from jaxinfer.errors import ConfigError
    from jaxinfer.kv_cache import KVCache, KVLayers

    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=4)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, 11).astype(np.int32)
    md = single_sequence_md(range(11), [3, 1, 2], 4, 8)
    engine = EngineConfig(page_size=4, max_model_len=32, max_num_seqs=1)
    runners = [ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32, unroll_layers=u))
               for u in (False, True)]
    stacked_alloc = runner_mod.allocate_kv
    monkeypatch.setattr(runner_mod, "allocate_kv", lambda c, e, layout, scales=None:
                        stacked_alloc(c, e.replace(unroll_layers=False), layout, scales))
    runners.append(ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32,
                                                         unroll_layers=True)))
    forms = [type(r.kv) for r in runners]
    assert forms == [KVCache, KVLayers, KVCache], forms
    assert len(runners[1].kv.layers) == cfg.num_layers
    assert runners[1].kv.layers[0].k.shape == (1,) + runners[0].kv.k.shape[1:]
    got = [r.all_logits(tokens, md) for r in runners]
    caches = [jax.tree.leaves(r.kv.stacked()) for r in runners]
    assert np.abs(np.asarray(caches[0][0])).sum() > 0
    for g, c in zip(got[1:], caches[1:]):
        np.testing.assert_allclose(g, got[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(c, caches[0]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    # a pool of the wrong form or depth is refused, not misread
    runners[0].kv = KVLayers.allocate(cfg.num_layers, cfg.num_kv_heads, 8, 4, cfg.head_dim,
                                      jnp.float32)
    with pytest.raises(ConfigError, match="scanned decoder"):
        runners[0].all_logits(tokens, md)
    runners[1].kv = KVLayers.allocate(cfg.num_layers - 1, cfg.num_kv_heads, 8, 4,
                                      cfg.head_dim, jnp.float32)
    with pytest.raises(ConfigError, match="KV pool of"):
        runners[1].all_logits(tokens, md)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_bf16_linear_pads_few_rows_on_gpu(m):
    """On the GPU a bf16 linear with M < Routes.min_gemm_rows runs its dot on M padded to
    that many rows (XLA's M = 8 GEMM is faster): the rows come back unchanged, and bigger M
    is not padded. The GPU's routes, here on the CPU."""
    import jax
    from jaxinfer import ops
    routes = Routes.choose(EngineConfig(), "gpu")
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 96)) * 0.1, jnp.bfloat16)
    want = (np.asarray(x, np.float32) @ np.asarray(w, np.float32)).astype(jnp.bfloat16)
    got = ops.linear(x, w, None, None, routes)
    assert got.shape == (m, 96) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2 ** -7, atol=1e-3)
    dots = [e for e in jax.make_jaxpr(lambda x, w: ops.linear(x, w, None, None, routes))(
        x, w).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [d.invars[0].aval.shape[0] for d in dots] == [max(m, routes.min_gemm_rows)]


def test_decode_step_padded_to_min_rows_equals_unpadded():
    """On the GPU a decode step of fewer than Routes.decode_min_rows rows runs padded to that
    many (kv_cache.pad_decode_rows): the real rows' logits and everything written to the
    cache are the same as unpadded, the padding rows write nothing, and attention runs on the
    real rows only. Forced on the CPU by the routes; the step's jaxpr shows 8-row activations
    and the attention call's row count."""
    import jax
    import jax.extend
    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=6)
    engine = EngineConfig(page_size=4, max_model_len=32, max_num_seqs=2)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (6, 9)]
    pages = [[3, 1], [2, 5, 4]]
    nxt = rng.integers(0, cfg.vocab_size, 2).astype(np.int32)
    pos = np.array([len(p) for p in prompts], np.int32)
    table = np.zeros((2, engine.pages_per_seq), np.int32)
    for b, ids in enumerate(pages):
        table[b, :len(ids)] = ids
    slots = table[np.arange(2), pos // 4] * 4 + pos % 4
    decode_md = AttentionMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(slots, jnp.int32),
        token_seq=jnp.arange(2, dtype=jnp.int32), page_table=jnp.asarray(table),
        seq_lens=jnp.asarray(pos + 1), query_start=jnp.asarray([0, 1, 2], jnp.int32),
        decode_only=True)

    def run(min_rows):
        runner = ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32),
                             Routes(decode_min_rows=min_rows))
        for p, ids in zip(prompts, pages):
            runner.all_logits(p, single_sequence_md(range(len(p)), ids, 4,
                                                    engine.pages_per_seq))
        before = np.asarray(runner.kv.stacked().k).copy()
        jaxpr = jax.make_jaxpr(lambda kv: runner._logits_fn(
            runner.params, kv, jnp.asarray(nxt), decode_md))(runner.kv)
        logits = runner.all_logits(nxt, decode_md)
        kv = runner.kv.stacked()
        return logits, before, np.asarray(kv.k), np.asarray(kv.v), jaxpr.jaxpr

    def attention_rows(jaxpr):
        """Rows of q in every decode attention call of the step (nested jits searched)."""
        rows = []
        for e in jaxpr.eqns:
            if e.params.get("name") == "paged_attention_reference":
                rows.append(e.invars[0].aval.shape[0])
            rows += [r for sub in jax.extend.core.jaxprs_in_params(e.params)
                     for r in attention_rows(sub)]
        return rows

    plain, before, k_plain, v_plain, jaxpr_plain = run(1)
    padded, _, k_padded, v_padded, jaxpr_padded = run(8)
    # attention runs on the two real rows only (the one scanned layer), padded or not
    assert attention_rows(jaxpr_padded) == attention_rows(jaxpr_plain) == [2]
    jaxpr_plain, jaxpr_padded = str(jaxpr_plain), str(jaxpr_padded)
    assert padded.shape == plain.shape == (2, cfg.vocab_size)
    np.testing.assert_allclose(padded, plain, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(k_padded, k_plain)
    np.testing.assert_array_equal(v_padded, v_plain)
    assert (k_plain != before).any(), "the decode step wrote no K"
    rows8 = f"f32[8,{cfg.hidden_size}]"   # the 8-row activations, only when padded
    assert rows8 in jaxpr_padded and rows8 not in jaxpr_plain
