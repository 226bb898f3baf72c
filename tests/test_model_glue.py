"""The decoder layer's fused glue (ops.FUSED_GLUE's kernels, the fused decode front with its
folded RMSNorm, the split combine) against the unfused route, on a tiny random model."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dense_reference import random_flat
from jaxinfer.config import EngineConfig, standard_config
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.kv_cache import single_sequence_metadata as single_sequence_md
from jaxinfer.params import build_model
from jaxinfer.runner import ModelRunner

@pytest.mark.parametrize("unroll,bias", [(False, False), (True, False), (True, True)])
def test_fused_glue_equals_unfused(monkeypatch, unroll, bias):
    """ops.FUSED_GLUE's kernels (RoPE + K/V write, residual add + RMSNorm, attention over the
    real rows with the combine kernel padding the rest) against the unfused route, with
    Pallas attention in interpret mode: a prefill and a decode step padded to 8 rows give the
    same logits and the same cache, and the fused decode step's jaxpr holds the fused kernels
    in place of the unfused K/V write. add_rmsnorm runs its kernel only on the GPU (and with
    ops.PALLAS_ADD_NORM on), so here ops' entry is pointed at the kernel in interpret mode.
    (The tiny context is not split: the combine kernel has its own tests in
    test_paged_attention.py.) With a QKV bias (Qwen2) the fused route adds it in the RoPE
    kernel, the unfused one in the projection. Three routes: unfused, the glue kernels with
    ops.FUSED_DECODE_QKV_MAX_ROWS 0, and with it on, where the decode step's QKV sum, RoPE
    and K/V write run inside the decode kernel (pallas_kernels/decode_qkv.py) instead."""
    import jax
    import jax.extend
    from jaxinfer import ops
    from pallas_kernels import rmsnorm
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
    monkeypatch.setattr(ops, "decode_rows", lambda r: max(r, 8))
    real_add_rmsnorm = ops.add_rmsnorm

    def kernel_add_rmsnorm(x, delta, weight, *, eps, layout=None):
        if not ops.FUSED_GLUE:
            return real_add_rmsnorm(x, delta, weight, eps=eps)
        return rmsnorm.add_rmsnorm(x, weight, delta, eps=eps, interpret=True)

    monkeypatch.setattr(ops, "add_rmsnorm", kernel_add_rmsnorm)

    def run(fused, front=0, folds=(True, False)):
        monkeypatch.setattr(ops, "FUSED_GLUE", fused)
        monkeypatch.setattr(ops, "FUSED_DECODE_QKV_MAX_ROWS", front)
        monkeypatch.setattr(ops, "FRONT_NORM", folds[0])
        monkeypatch.setattr(ops, "FOLD_MLP_NORM", folds[1])
        runner = ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32,
                                                       unroll_layers=unroll))
        pre = runner.all_logits(prompt, single_sequence_md(range(7), ids, 4,
                                                          engine.pages_per_seq))
        nxt = jnp.asarray([int(np.argmax(pre[-1]))], jnp.int32)
        jaxpr = jax.make_jaxpr(lambda kv: runner._logits_fn(
            runner.params, kv, nxt, decode_md))(runner.kv)
        dec = runner.all_logits(np.asarray(nxt), decode_md)
        kv = runner.kv.stacked()
        return pre, dec, np.asarray(kv.k), np.asarray(kv.v), kernels(jaxpr.jaxpr)

    def kernels(jaxpr):
        """The names of the step's Pallas calls (nested jits searched)."""
        names = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        for e in jaxpr.eqns:
            names += [n for sub in jax.extend.core.jaxprs_in_params(e.params)
                      for n in kernels(sub)]
        return names

    pre_u, dec_u, k_u, v_u, jaxpr_u = run(False)
    pre_q, dec_q, k_q, v_q, jaxpr_q = run(True, front=8)
    pre_f, dec_f, k_f, v_f, jaxpr_f = run(True)
    # the front with neither RMSNorm folded, and with both (the default folds only the first)
    other_folds = [run(True, front=8, folds=f) for f in ((False, False), (True, True))
                   if unroll and not bias]
    for pre, dec, k, v in [(pre_f, dec_f, k_f, v_f), (pre_q, dec_q, k_q, v_q)] + [
            r[:4] for r in other_folds]:
        np.testing.assert_allclose(pre, pre_u, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(dec, dec_u, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(k, k_u, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(v, v_u, atol=1e-5, rtol=1e-5)
    assert np.abs(k_f).sum() > 0
    # the scan traces one layer; unrolled, the first layer (nothing to add) and the rest
    # are the inner jit's two traces
    layers = 1 if not unroll else 2
    # per layer: the rope write, two add + norms; unrolled, the final norm takes the last
    # layer's add too (the scan adds it in its body and norms with the plain RMSNorm)
    assert jaxpr_f.count("jaxinfer_rope_kv_write") == layers
    assert jaxpr_f.count("add_rmsnorm") == 2 * layers + unroll
    assert "jaxinfer_kv_write" not in jaxpr_f and "add_rmsnorm" not in jaxpr_u
    assert jaxpr_u.count("jaxinfer_kv_write") == layers
    assert "jaxinfer_rope_kv_write" not in jaxpr_u
    # the decode front: neither write kernel, the decode kernel's fused form in each layer
    assert jaxpr_q.count("jaxinfer_paged_decode_qkv") == layers
    # the RMSNorm before QKV folded into it (ops.FRONT_NORM): of the add + norms, the MLP
    # side's per layer and the final one (unrolled); neither folded: both per layer; with
    # FOLD_MLP_NORM too: the final one alone
    assert jaxpr_q.count("add_rmsnorm") == layers + unroll
    if other_folds:
        assert [r[4].count("add_rmsnorm") for r in other_folds] == [2 * layers + unroll, unroll]
    assert not {"jaxinfer_rope_kv_write", "jaxinfer_kv_write"} & set(jaxpr_q)
    assert "jaxinfer_paged_decode_qkv" not in jaxpr_f + jaxpr_u


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_mlp_with_folded_norm_equals_normed_rows(dtype, tol):
    """model.MLP with `norm` (ops.FOLD_MLP_NORM): gate/up over x times the norm's weight,
    each row's 1 / rms(x) on gate and up before SiLU, equals the MLP over the normed rows
    (bf16: to its roundings); rows of very different scales, so a missing factor shows."""
    from flax import nnx
    from jaxinfer import model
    cfg = standard_config("tiny")
    mlp = model.MLP(cfg, rngs=nnx.Rngs(0), dtype=dtype)
    norm = model.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    rng = np.random.default_rng(3)
    norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, cfg.hidden_size), dtype)
    x = jnp.asarray(rng.standard_normal((3, cfg.hidden_size)) * [[0.1], [1], [30]], dtype)
    want = np.asarray(mlp(norm(x)), np.float32)
    got = np.asarray(mlp(x, norm=norm), np.float32)
    def rel(y):
        return np.linalg.norm(y - want) / np.linalg.norm(want)

    assert rel(got) < tol
    assert rel(np.asarray(mlp(x * norm.weight[...]), np.float32)) > 0.5   # no factor


def test_split_decode_combined_in_the_kernel(monkeypatch):
    """The unrolled decoder's decode steps with the fused front on a split grid: with
    ops.LAST_COMBINES the splits merge in the decode kernel (per-step counters handed from
    layer to layer), without it in split_combine's kernel; the same logits and cache over
    three steps, no combine kernel in the first's jaxpr, and no counters left in the pool."""
    import jax
    from jaxinfer import ops
    from pallas_kernels import decode_qkv as dq
    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=14)
    engine = EngineConfig(page_size=4, max_model_len=32, max_num_seqs=2,
                          attention_impl="pallas")
    tokens = np.random.default_rng(15).integers(0, cfg.vocab_size, 12).astype(np.int32)
    ids = [3, 1, 5]
    monkeypatch.setattr(ops, "decode_rows", lambda r: max(r, 8))
    table_blocks = dq.table_blocks
    monkeypatch.setattr(dq, "table_blocks", lambda *a: dataclasses.replace(
        table_blocks(*a), block_tokens=16, num_splits=2))
    switches = ops.switches     # the layer's trace cache keys on them: not another test's
    monkeypatch.setattr(ops, "switches", lambda: switches() + ("two splits",))

    def run(last):
        monkeypatch.setattr(ops, "LAST_COMBINES", last)
        runner = ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32,
                                                       unroll_layers=True))
        out = [runner.all_logits(tokens[:9], single_sequence_md(range(9), ids, 4,
                                                                engine.pages_per_seq))]
        first = single_sequence_md([9], ids, 4, engine.pages_per_seq)
        assert first.decode_only
        text = str(jax.make_jaxpr(lambda kv: runner._logits_fn(
            runner.params, kv, jnp.asarray(tokens[9:10]), first))(runner.kv))
        for pos in range(9, 12):
            out.append(runner.all_logits(tokens[pos:pos + 1], single_sequence_md(
                [pos], ids, 4, engine.pages_per_seq)))
        assert all(c.counters is None for c in runner.kv.layers)
        kv = runner.kv.stacked()
        return np.concatenate(out), np.asarray(kv.k), np.asarray(kv.v), text

    got, k, v, text = run(True)
    want, k_want, v_want, text_want = run(False)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(k, k_want)
    np.testing.assert_array_equal(v, v_want)
    assert "jaxinfer_paged_decode_combine" in text_want
    assert "jaxinfer_paged_decode_combine" not in text
    assert "jaxinfer_paged_decode_qkv" in text


@pytest.mark.gpu
@pytest.mark.parametrize("unroll", [False, True])
def test_gpu_fused_glue_equals_unfused(monkeypatch, unroll):
    """On the GPU, compiled: ops.FUSED_GLUE's kernels against the unfused route on the tiny
    model in f32 (Pallas attention, a decode step of one row padded to 8 by ops.decode_rows):
    a prefill and four decode steps give the same logits and the same cache."""
    import jax
    from jaxinfer import ops
    assert jax.default_backend() == "gpu"
    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=12)
    engine = EngineConfig(page_size=4, max_model_len=32, max_num_seqs=2,
                          attention_impl="pallas")
    prompt = np.random.default_rng(13).integers(0, cfg.vocab_size, 9).astype(np.int32)
    ids = [3, 1, 5, 2]

    def run(fused):
        monkeypatch.setattr(ops, "FUSED_GLUE", fused)
        runner = ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32,
                                                       unroll_layers=unroll))
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
    # between the routes moves a logit by up to ~1e-3 relative (the scan's run: 2.8e-4 abs).
    # The decode steps' K/V come from QKV's partial products (ops.decode_qkv_attention), a
    # GEMM of its own under TF32: 3.0e-4 abs from the unfused route's on the H200 (their
    # values ~0.02-1); the prefill's slots (positions 0-8) are written alike
    np.testing.assert_allclose(logits_f, logits_u, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(k_f, k_u, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(v_f, v_u, atol=2e-3, rtol=2e-3)
    pages, slots = zip(*[(ids[p // 4], p % 4) for p in range(9)])
    for f, u in ((k_f, k_u), (v_f, v_u)):
        np.testing.assert_allclose(f[:, :, pages, slots], u[:, :, pages, slots], atol=1e-5,
                                   rtol=1e-5)
    assert np.abs(k_f[:, :, ids[3], 0]).sum() > 0       # position 12, the last decode step
    assert np.array_equal(np.argmax(logits_f, -1), np.argmax(logits_u, -1))
