"""Sampling: greedy, distribution, truncation, penalties, seeds, logprobs, padding, recompiles."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.request import SamplingParams
from jaxinfer.sampling import (SampleOutput, SamplingArrays, apply_penalties, sample,
                               truncation_threshold)

V = 1000
sample_jit = jax.jit(sample, static_argnames="candidates")
_threshold_jit = jax.jit(truncation_threshold, static_argnums=2)


def _logits(rng, b, v=V, scale=3.0):
    return jnp.asarray(rng.normal(size=(b, v)) * scale, jnp.float32)


def _arrays(params, counts=None, token_ids=None, batch_size=None, window=64):
    counts = counts if counts is not None else [0] * len(params)
    return SamplingArrays.from_params(params, counts, token_ids,
                                      batch_size=batch_size or len(params), window=window)


@pytest.mark.parametrize("sampled_rows", [0, 2])
def test_greedy_is_argmax_with_padding_rows(sampled_rows):
    rng = np.random.default_rng(0)
    logits = _logits(rng, 8, scale=0.1)  # flat: a sampled row would rarely hit the argmax
    params = ([SamplingParams(temperature=0.0, top_k=50)] * 5
              + [SamplingParams(temperature=1.0)] * sampled_rows + [None] * (3 - sampled_rows))
    out = sample_jit(logits, _arrays(params), jax.random.key(1))
    assert isinstance(out, SampleOutput) and out.tokens.dtype == jnp.int32
    greedy = [i for i, p in enumerate(params) if p is None or p.temperature == 0]
    np.testing.assert_array_equal(np.asarray(out.tokens)[greedy],
                                  np.argmax(np.asarray(logits), -1)[greedy])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_temperature_sampling_matches_softmax(temperature):
    rng = np.random.default_rng(1)
    n, v = 8192, 6
    row = rng.normal(size=v).astype(np.float32)
    logits = jnp.asarray(np.tile(row, (n, 1)))
    arrays = _arrays([SamplingParams(temperature=temperature)] * n)
    tokens = np.asarray(sample_jit(logits, arrays, jax.random.key(7)).tokens)
    expected = n * np.asarray(jax.nn.softmax(row / temperature))
    chi2 = np.sum((np.bincount(tokens, minlength=v) - expected) ** 2 / expected)
    assert chi2 < 30.0, chi2  # 5 dof: p(chi2 > 30) ~ 1e-5


@pytest.mark.parametrize("candidates", [256, 16])  # 16 forces the full-sort fallback
def test_truncation_never_returns_excluded_tokens(candidates):
    rng = np.random.default_rng(2)
    b = 8
    logits = _logits(rng, b, scale=1.5)
    kinds = [dict(top_k=1), dict(top_k=5), dict(top_k=40), dict(top_p=0.3), dict(top_p=0.9),
             dict(min_p=0.2), dict(top_k=30, top_p=0.5), dict(top_p=0.7, min_p=0.05)]
    params = [SamplingParams(temperature=0.9, **kinds[i % len(kinds)]) for i in range(b)]
    allowed = _allowed_reference(np.asarray(logits) / 0.9, params)
    seen = np.zeros((b, V), bool)
    for step in range(60):
        out = sample_jit(logits, _arrays(params), jax.random.key(step), candidates=candidates)
        seen[np.arange(b), np.asarray(out.tokens)] = True
    assert not np.any(seen & ~allowed)
    assert np.all(seen.sum(-1) >= np.minimum(allowed.sum(-1), 2))  # it does sample, not argmax


def _allowed_reference(scaled, params):
    """numpy top-k -> top-p (renormalized over top-k) -> min-p keep mask, by full sort."""
    allowed = np.zeros(scaled.shape, bool)
    for b, p in enumerate(params):
        order = np.argsort(-scaled[b])
        k = p.top_k or scaled.shape[1]
        top = scaled[b, order[:k]]
        probs = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
        cum = np.cumsum(probs)
        n = k if p.top_p >= 1 else int(np.sum(cum - probs < p.top_p))
        keep = order[:n]
        full = np.exp(scaled[b] - scaled[b].max())
        keep = keep[full[keep] >= p.min_p * full.max()]
        allowed[b, keep] = True
    return allowed


_KINDS = [dict(top_k=600, top_p=0.5), dict(top_k=600), dict(top_k=300, top_p=0.99),
          dict(top_p=0.97), dict(top_k=7, top_p=0.8, min_p=0.01), dict(min_p=0.3),
          dict(top_p=0.6), dict(top_k=200, top_p=0.9)]


@pytest.mark.parametrize("candidates", [256, 16])
@pytest.mark.parametrize("kinds", [_KINDS] + [[k] for k in _KINDS],
                         ids=["mixed"] + [str(k) for k in _KINDS])
def test_truncation_mask_equals_full_sort_reference(candidates, kinds):
    # A batch of one kind shows whether that kind alone finds the right path (the candidates
    # or the full sort); the mixed batch, whether rows sharing a path keep their own cuts.
    rng = np.random.default_rng(10)
    scaled = _logits(rng, 8, scale=1.5)
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(8)]
    cut = _threshold_jit(scaled, _arrays(params), candidates)
    mask = np.asarray(scaled >= cut[:, None])
    np.testing.assert_array_equal(mask, _allowed_reference(np.asarray(scaled), params))


def test_top_p_over_many_candidates_uses_full_sort():
    # Nearly flat logits: top_p=0.9 keeps ~900 tokens, far beyond 256 candidates.
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(8, V)) * 0.01, jnp.float32)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=600)] * 4
    allowed = _allowed_reference(np.asarray(logits), params)
    hits = np.zeros((8, V), bool)
    for step in range(60):
        toks = np.asarray(sample_jit(logits, _arrays(params), jax.random.key(step)).tokens)
        hits[np.arange(8), toks] = True
    assert not np.any(hits & ~allowed)
    # Tokens ranked past the 256 candidates are drawn too.
    ranks = np.argsort(np.argsort(-np.asarray(logits), -1), -1)
    assert np.any(hits & (ranks >= 256))


def _penalty_reference(logits, params, contexts, counts):
    out = logits.copy()
    for b, (p, ctx, n_out) in enumerate(zip(params, contexts, counts)):
        for t in set(ctx):
            out[b, t] = out[b, t] / p.repetition_penalty if out[b, t] > 0 \
                else out[b, t] * p.repetition_penalty
        output = ctx[len(ctx) - n_out:]
        for t in set(output):
            out[b, t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(4)
    b = 6
    logits = np.asarray(_logits(rng, b))
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(frequency_penalty=-1.0),
              SamplingParams(presence_penalty=1.5, frequency_penalty=0.3),
              SamplingParams(),
              SamplingParams(repetition_penalty=2.0, frequency_penalty=0.4)]
    contexts = [list(rng.integers(0, 50, size=rng.integers(5, 60))) for _ in range(b)]
    counts = [min(int(rng.integers(0, 30)), len(c)) for c in contexts]
    counts[1] = 0  # prompt only
    arrays = _arrays(params, counts, contexts, window=64)
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), arrays))
    np.testing.assert_allclose(got, _penalty_reference(logits, params, contexts, counts),
                               rtol=1e-6, atol=1e-6)


def test_penalty_window_keeps_last_tokens_only():
    ctx = list(range(100, 130))  # 30 tokens, 10 of them output; window 8
    arrays = _arrays([SamplingParams(frequency_penalty=1.0)], [10], [ctx], window=8)
    np.testing.assert_array_equal(arrays.penalty_tokens[0], ctx[-8:])
    assert arrays.output_start[0] == 0
    with pytest.raises(ValueError, match="no token_ids"):
        _arrays([SamplingParams(presence_penalty=1.0)], [0], None)


def test_variant_plain_only_for_all_greedy_rows():
    greedy = _arrays([SamplingParams(temperature=0.0), None], batch_size=4)
    assert greedy.penalty_tokens.shape == (4, 0) and not greedy.full
    for p in (SamplingParams(temperature=0.5), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, presence_penalty=0.5)):
        arrays = _arrays([SamplingParams(temperature=0.0), p], [0, 0], [[5], [5]],
                         batch_size=4)
        assert arrays.full and arrays.penalty_tokens.shape == (4, 64), p
        assert (arrays.penalty_tokens[0] == -1).all()  # a row without penalty sends nothing


def _primitives(jaxpr) -> set:
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    out |= _primitives(getattr(inner, "jaxpr", inner))
    return out


def test_plain_variant_has_no_conditional_and_is_argmax():
    """An XLA conditional on the GPU syncs the host on its predicate: the greedy path must
    have none (the full one has them)."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, V)).astype(np.float32))
    plain = _arrays([SamplingParams(temperature=0.0)] * 2, batch_size=4)
    full = _arrays([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
                   batch_size=4)
    key = jax.random.key(0)
    prims = _primitives(jax.make_jaxpr(sample)(logits, plain, key).jaxpr)
    assert "cond" not in prims and "argmax" in prims
    assert "cond" in _primitives(jax.make_jaxpr(sample)(logits, full, key).jaxpr)
    out = sample(logits, plain, key)
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), axis=-1))
    assert np.isneginf(np.asarray(out.logprob)).all()
    # The same greedy rows in the full variant pick the same tokens.
    np.testing.assert_array_equal(sample(logits, full, key).tokens[0], out.tokens[0])


def test_seed_reproducible_across_batches_and_rows():
    rng = np.random.default_rng(5)
    row = rng.normal(size=V).astype(np.float32)
    req = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(position, batch, others_seed):
        toks = []
        for step in range(12):
            logits = _logits(rng, batch).at[position].set(row)
            params = [SamplingParams(temperature=1.0, seed=others_seed + i) if i % 2 else None
                      for i in range(batch)]
            params[position] = req
            counts = [step] * batch
            out = sample_jit(logits, _arrays(params, counts), jax.random.key(100 + step))
            toks.append(int(out.tokens[position]))
        return toks

    a, b, c = run(0, 8, 1), run(5, 8, 99), run(2, 8, 8)
    assert a == b == c
    assert len(set(a)) > 1  # the step is folded into the key: not the same token every step


def test_seeded_key_is_fold_in_of_jax_key():
    rng = np.random.default_rng(6)
    logits = _logits(rng, 8, scale=0.1)
    params = [SamplingParams()] * 8
    params[5] = SamplingParams(seed=42)
    tok = int(sample_jit(logits, _arrays(params, [3] * 8), jax.random.key(0)).tokens[5])
    key = jax.random.fold_in(jax.random.key(42), 3)
    expected = int(jnp.argmax(logits[5] + jax.random.gumbel(key, (V,), jnp.float32)))
    assert tok == expected
    big = _arrays([SamplingParams(seed=2**62 + 5)], [0])
    np.testing.assert_array_equal(big.seed[0], [2**30, 5])


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(7)
    logits = _logits(rng, 8)
    params = [SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5), None,
              SamplingParams(temperature=0.0, logprobs=20), SamplingParams(logprobs=0)]
    arrays = _arrays(params, [2, 0, 0, 0], [[1, 2, 3], None, None, None], batch_size=8)
    out = sample_jit(logits, arrays, jax.random.key(3))
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    toks = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprob, ref[np.arange(8), toks], rtol=1e-5, atol=1e-5)
    order = np.argsort(-ref, -1)[:, :20]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1),
                               rtol=1e-5, atol=1e-5)
    # The chosen token's rank in the whole vocabulary (raw logits; itself counted, as vLLM):
    # 1 for the greedy rows, above 1 for a row whose hot sample is not the argmax.
    rank = (ref >= ref[np.arange(8), toks][:, None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(out.rank)[[0, 2, 3]], rank[[0, 2, 3]])
    assert np.asarray(out.rank)[2] == 1


def test_rank_of_a_token_outside_the_top():
    """Hot sampling over flat logits picks tokens far down the order: each one's rank is
    the count of tokens at least as likely, ties included."""
    logits = jnp.asarray(np.tile(np.linspace(0.0, -1.0, 64), (8, 1)), jnp.float32)
    logits = logits.at[:, 5].set(logits[0, 4])            # a tie between ids 4 and 5
    params = [SamplingParams(temperature=50.0, seed=s, logprobs=1) for s in range(8)]
    arrays = _arrays(params, [0] * 8, [None] * 8, batch_size=8)
    out = sample_jit(logits, arrays, jax.random.key(0))
    ref = np.asarray(logits)
    toks = np.asarray(out.tokens)
    want = (ref >= ref[np.arange(8), toks][:, None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(out.rank), want)
    assert want.max() > 5                                 # some picks lie far below the top


def test_padding_rows_do_not_change_real_rows():
    rng = np.random.default_rng(8)
    logits = _logits(rng, 8)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=s) for s in range(3)]
    others = [SamplingParams(temperature=1.5, top_p=0.5, logprobs=2)] * 5
    busy = sample_jit(logits, _arrays(params + others), jax.random.key(1))
    padded_logits = logits.at[3:].set(jnp.nan)  # padding rows' logits may be garbage
    padded = sample_jit(padded_logits, _arrays(params, batch_size=8), jax.random.key(0))
    np.testing.assert_array_equal(busy.tokens[:3], padded.tokens[:3])
    assert np.all((np.asarray(padded.tokens) >= 0) & (np.asarray(padded.tokens) < V))


def test_new_parameter_values_do_not_recompile():
    traces = []

    @jax.jit
    def step(logits, arrays, rng):
        traces.append(1)
        return sample(logits, arrays, rng)

    rng = np.random.default_rng(9)
    logits = _logits(rng, 4)
    for params in ([None] * 4, [SamplingParams(temperature=0)] * 2 + [None] * 2):
        jax.block_until_ready(step(logits, _arrays(params, [5] * 4), jax.random.key(0)))
    assert len(traces) == 1  # the plain variant
    ctx = [[1, 2, 3]] * 4
    variants = [[SamplingParams(temperature=0.5, top_k=3, seed=1, logprobs=2)] * 4,
                [SamplingParams(top_p=0.4, min_p=0.1), None, SamplingParams(temperature=0), None],
                [SamplingParams(temperature=2.0, top_k=700)] * 4,
                [SamplingParams(repetition_penalty=1.2)] * 4,
                [SamplingParams(presence_penalty=0.3, temperature=0.7)] * 4]
    for params in variants:
        jax.block_until_ready(step(logits, _arrays(params, [5] * 4, ctx), jax.random.key(0)))
    assert len(traces) == 2  # the one extra variant: full


def test_banned_ids_are_never_sampled_and_logprobs_stay_raw():
    """min_tokens' mask: a row's banned ids (its EOS / stop ids) lose to every other token,
    greedy or sampled; -1 padding and unbanned rows are untouched; logprobs stay raw."""
    rng = np.random.default_rng(5)
    logits = np.asarray(_logits(rng, 4))
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    params = [SamplingParams(temperature=0.0, min_tokens=3, logprobs=1),
              SamplingParams(temperature=1.0, top_k=1, min_tokens=3),
              SamplingParams(temperature=0.0, logprobs=1), None]
    banned = [[int(top2[0, 0]), 7], [int(top2[1, 0])], [], []]
    arrays = SamplingArrays.from_params(params, [0] * 4, batch_size=4, window=8, banned=banned)
    assert arrays.banned.shape == (4, 32)
    out = sample_jit(jnp.asarray(logits), arrays, jax.random.key(0))
    tokens = np.asarray(out.tokens)
    assert tokens[0] == top2[0, 1] and tokens[1] == top2[1, 1]
    np.testing.assert_array_equal(tokens[2:], np.argmax(logits, -1)[2:])
    assert int(np.asarray(out.top_ids)[0, 0]) == top2[0, 0]       # raw: the banned id first
    # min_tokens alone sends a greedy row to the full variant.
    assert SamplingArrays.from_params([SamplingParams(temperature=0.0, min_tokens=1)], [0],
                                      batch_size=1).full


def test_sampling_arrays_read_each_row_its_own_params():
    """Each row's columns are its own SamplingParams' fields, whether rows share one object,
    hold equal copies or differ; seeds split into exact 32-bit halves; padding rows are
    greedy and unseeded."""
    kinds = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=2**62 + 5,
                            logprobs=3),
             SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=-0.5,
                            frequency_penalty=0.25),
             SamplingParams(temperature=0.0)]
    rows = [kinds[i % 3] for i in range(7)]
    copies = [SamplingParams(**{f: getattr(p, f) for f in SamplingParams.fields()})
              for p in rows]
    contexts = [list(range(i + 5)) for i in range(7)]
    want = {
        "temperature": [0.7, 0, 0] * 2 + [0.7, 0],
        "top_k": [40, 0, 0] * 2 + [40, 0], "top_p": [0.9, 1, 1] * 2 + [0.9, 1],
        "min_p": [0.05, 0, 0] * 2 + [0.05, 0],
        "repetition_penalty": [1, 1.2, 1] * 2 + [1, 1],
        "presence_penalty": [0, -0.5, 0] * 2 + [0, 0],
        "frequency_penalty": [0, 0.25, 0] * 2 + [0, 0],
        "num_logprobs": [3, -1, -1] * 2 + [3, -1],
        "has_seed": [True, False, False] * 2 + [True, False]}
    for params in (rows, copies):
        a = SamplingArrays.from_params(params, list(range(7)), contexts, batch_size=8, window=4)
        for name, values in want.items():
            np.testing.assert_allclose(getattr(a, name), np.array(values, np.float32),
                                       err_msg=name)
        np.testing.assert_array_equal(a.seed[0], [2**30, 5])
        assert (a.seed[1:3] == 0).all() and (a.seed[7] == 0).all()
        assert a.full and a.penalty_tokens.shape == (8, 4)
        np.testing.assert_array_equal(a.penalty_tokens[[1, 4]], [[2, 3, 4, 5], [5, 6, 7, 8]])
        assert (a.penalty_tokens[[0, 2, 3, 5, 6, 7]] == -1).all()
    greedy = SamplingArrays.from_params([kinds[2]] * 3, [0] * 3, batch_size=4)
    assert not greedy.full and greedy.banned.shape == (4, 0)


def test_sampling_arrays_leave_the_params_as_they_were():
    """What from_params keeps per SamplingParams lives outside it: vars(p) stays its fields
    (SamplingParams(**vars(p)) rebuilds it), and the entry goes when p is collected."""
    import gc
    from jaxinfer import sampling_columns
    p = SamplingParams(temperature=0.5, seed=3, n=2)
    before = dict(vars(p))
    SamplingArrays.from_params([p], [0], batch_size=1)
    assert vars(p) == before and SamplingParams(**vars(p)) == p
    key = id(p)
    assert key in sampling_columns._ROWS
    del p
    gc.collect()
    assert key not in sampling_columns._ROWS
