"""Ragged paged attention (several new tokens per sequence, causal within the chunk) vs its
plain-jnp reference, and against the decode kernel where the two must agree. Same tolerance
reasoning as tests/kernels/test_paged_attention.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kv_cache import AttentionMetadata
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_blocks,
                                                   ragged_paged_attention_reference, work_list)
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels import tuning
from pallas_kernels.tuning import RaggedBlocks
from test_paged_attention import (BF, HF, KV_HEADS, MODES, PAGES_PER_SEQ, PR, make_cache,
                                  rel_err, row_rel_err, stress_cache)


def make_ragged(seed, page_size, groups, head_dim, kv_dtype, q_lens, num_tokens):
    """Rows with new-token counts q_lens (0 = padded row) at random context lengths, packed
    into T = num_tokens tokens; the tail of T is padding (slot -1)."""
    rng = np.random.default_rng(seed)
    batch, cap = len(q_lens), PAGES_PER_SEQ * page_size
    num_pages = 1 + batch * PAGES_PER_SEQ
    table = (1 + rng.permutation(num_pages - 1)).reshape(batch, PAGES_PER_SEQ)
    seq_lens = np.array([0 if n == 0 else int(rng.integers(n, cap + 1)) for n in q_lens])
    seq_lens[0] = cap  # one row runs to the end of its table
    table[np.asarray(q_lens) == 0] = 0
    positions = np.zeros(num_tokens, np.int32)
    token_seq = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    for b, n in enumerate(q_lens):
        pos = np.arange(seq_lens[b] - n, seq_lens[b])
        positions[start[b]:start[b + 1]] = pos
        token_seq[start[b]:start[b + 1]] = b
        slots[start[b]:start[b + 1]] = table[b, pos // page_size] * page_size + pos % page_size
    md = AttentionMetadata(*(jnp.asarray(x, jnp.int32) for x in
                             (positions, slots, token_seq, table, seq_lens, start)))
    cache, _ = make_cache(rng, page_size, head_dim, kv_dtype, num_pages)
    q = jnp.asarray(rng.standard_normal((num_tokens, KV_HEADS * groups, head_dim)),
                    jnp.bfloat16)
    return q, cache, md


# (page size, q heads per kv head, head dim, kv dtype, block_q, block tokens, q_lens, T,
#  fp8 compute, flags: 1 page-table prefetch, 2 heavy_first)
GRID = [
    (8, 4, 64, "bf16", 4, 16, [7, 1, 0, 12], 24, BF, 0),
    (16, 1, 128, "fp8", 8, 32, [9, 3, 16], 32, HF, 1),
    (32, 8, 64, "bf16", 2, 32, [5, 0, 1, 4], 12, BF, 2),
    (16, 3, 64, "fp8", 4, 16, [6, 6], 16, BF, 1),
    (8, 8, 128, "fp8", 16, 16, [20, 2], 24, HF, 2),
    (32, 1, 64, "bf16", 16, 64, [33, 1], 40, BF, 3),
    (16, 4, 128, "fp8", 8, 32, [9, 1, 14], 28, PR, 3),
    (8, 4, 64, "fp8s", 4, 16, [5, 1, 9], 16, HF, 1),      # static FP8 scales
    (16, 4, 128, "fp8s", 8, 32, [9, 1, 14], 28, PR, 3),
]


@pytest.mark.parametrize("page_size,groups,head_dim,kv_dtype,q_lens,t",
                         [(g[0], g[1], g[2], g[3], g[6], g[7]) for g in GRID]
                         + [(16, 4, 64, "fp8", [3, 1, 0, 1, 5, 1, 1, 2, 1, 4], 24)])
def test_reference_forms_agree(page_size, groups, head_dim, kv_dtype, q_lens, t):
    """The reference's two forms, per row (the pages of each row gathered once; what
    ragged_paged_attention_reference uses up to REFERENCE_ROWS rows, so in the kernel tests
    here) and per token (each token gathers its row's pages), give the same outputs."""
    q, (k, v, ks, vs), md = make_ragged(7, page_size, groups, head_dim, kv_dtype, q_lens, t)
    args = (q, k, v, jnp.int32(1), md, ks, vs, head_dim ** -0.5)
    rows, tokens = rpa._reference_rows(*args), rpa._reference_tokens(*args)
    live = np.asarray(md.slot_mapping) >= 0
    assert live.sum() == sum(q_lens) and np.abs(np.asarray(tokens)[live]).max() > 0.01
    np.testing.assert_allclose(np.asarray(rows)[live], np.asarray(tokens)[live],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("page_size,groups,head_dim,kv_dtype,block_q,tokens,q_lens,t,compute,"
                         "flags", GRID)
def test_kernel_matches_reference(page_size, groups, head_dim, kv_dtype, block_q, tokens,
                                  q_lens, t, compute, flags, interpret):
    q, (k, v, ks, vs), md = make_ragged(sum(q_lens) * page_size + groups, page_size, groups,
                                        head_dim, kv_dtype, q_lens, t)
    scale = head_dim ** -0.5
    args = (q, k, v, jnp.int32(1), md, ks, vs)
    out = ragged_paged_attention_blocks(*args, sm_scale=scale, interpret=interpret,
                                        blocks=RaggedBlocks(block_q, tokens, 4, 2, compute,
                                                            bool(flags & 1), bool(flags & 2)))
    ref = ragged_paged_attention_reference(*args, sm_scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-2
    np.testing.assert_array_equal(np.asarray(out[sum(q_lens):], np.float32), 0.0)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("page_size,groups,head_dim,kv_dtype,block_q,tokens,q_lens,t,compute,"
                         "flags", GRID[::2])
def test_split_kernel_matches_reference(page_size, groups, head_dim, kv_dtype, block_q,
                                        tokens, q_lens, t, compute, flags, splits,
                                        interpret):
    """The context split `splits` ways (partials merged by the combine kernel): the same
    outputs, padding tokens zeros (the combine's live mask), every split count dividing the
    blocks unevenly somewhere (2 and 3 over 1..8 KV blocks), empty splits included."""
    q, (k, v, ks, vs), md = make_ragged(sum(q_lens) * page_size + groups, page_size, groups,
                                        head_dim, kv_dtype, q_lens, t)
    args = (q, k, v, jnp.int32(1), md, ks, vs)
    blocks = RaggedBlocks(block_q, tokens, 4, 2, compute, bool(flags & 1), bool(flags & 2),
                          num_splits=splits)
    out = ragged_paged_attention_blocks(*args, sm_scale=head_dim ** -0.5, interpret=interpret,
                                        blocks=blocks)
    ref = ragged_paged_attention_reference(*args, sm_scale=head_dim ** -0.5)
    assert rel_err(out, ref) < 1e-2
    np.testing.assert_array_equal(np.asarray(out[sum(q_lens):], np.float32), 0.0)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kv_dtype", ["fp8", pytest.param("fp8s", marks=pytest.mark.gpu)])
def test_public_entry_splits_long_context(kv_dtype, interpret, monkeypatch):
    """The split rule on a small grid over a long context (RAGGED_MIN_SPLIT_TOKENS lowered):
    the public entry splits the chunk's rows, sends the decode rows to the decode kernel and
    zeroes the padding tokens, matching the reference (per-token and, on the GPU only, to
    keep the CPU suite's time, static FP8 scales: the split kernels' static cases run on
    the CPU in test_split_kernel_matches_reference)."""
    monkeypatch.setattr(tuning, "RAGGED_MIN_SPLIT_TOKENS", 16)
    q_lens = [1, 6, 0, 5]
    q, (k, v, ks, vs), md = make_ragged(40, 16, 4, 128, kv_dtype, q_lens, 16)
    blocks = tuning.ragged_blocks(1, 128, 16, 16, k.shape[1], md.page_table.shape[1] * 16)
    assert blocks.num_splits > 1
    args = (q, k, v, jnp.int32(1), md, ks, vs)
    fn = functools.partial(ragged_paged_attention, sm_scale=128 ** -0.5, interpret=interpret)
    assert "jaxinfer_ragged_combine" in pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    out = fn(*args)
    ref = ragged_paged_attention_reference(*args, sm_scale=128 ** -0.5)
    assert row_rel_err(out[:12], ref[:12]) < 1e-2
    np.testing.assert_array_equal(np.asarray(out[12:], np.float32), 0.0)


def test_split_rule():
    """Splits fill a small grid up to ~TARGET_PROGRAMS over a long context, none at the
    throughput run's 2,048-token chunks or over short contexts."""
    floor = tuning.RAGGED_MIN_SPLIT_TOKENS
    assert tuning.ragged_splits(2048, 16, 8, 8192) == 1
    assert tuning.ragged_splits(256, 16, 8, 8192) == 2         # 128 programs -> 256
    assert tuning.ragged_splits(64, 16, 8, 8 * floor) == 8     # 32 programs -> 256
    assert tuning.ragged_splits(64, 16, 8, 4 * floor) == 4     # the floor limits it
    assert tuning.ragged_splits(64, 16, 8, floor) == 1         # too short to split
    assert tuning.ragged_blocks(1, 128, 16, 64, 8, 4 * floor).num_splits == 4
    assert tuning.ragged_blocks(1, 128, 16).num_splits == 1


@pytest.mark.parametrize("heavy_first", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_work_list_names_every_q_block_once(seed, heavy_first):
    """Any split of T tokens over B rows (zeros, ones, one long row, T not filled) fits the
    static W, and the list is exactly each row's q blocks in order (last first with
    heavy_first), then -1."""
    rng = np.random.default_rng(seed)
    batch, t, bq = int(rng.integers(1, 40)), int(rng.integers(1, 300)), int(rng.choice([1, 4, 16]))
    cuts = np.sort(rng.integers(0, t + 1, batch))      # row b has cuts[b] - cuts[b-1] tokens
    if seed == 0:
        cuts = np.full(batch, t)                        # one row takes everything
    q_lens = np.diff(np.concatenate([[0], cuts]))
    start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows, blocks = (np.asarray(x) for x in work_list(jnp.asarray(start), t, bq,
                                                     heavy_first=heavy_first))
    order = reversed if heavy_first else iter
    want = [(b, i) for b, n in enumerate(q_lens) for i in order(range(-(-n // bq)))]
    assert len(rows) == min(batch * -(-t // bq), batch + -(-t // bq)) >= len(want)
    assert list(zip(rows[:len(want)].tolist(), blocks[:len(want)].tolist())) == want
    assert np.all(rows[len(want):] == -1)


@pytest.mark.parametrize("interpret", MODES)
def test_public_entry_and_decode_agreement(interpret):
    """One new token per row is decode: ragged and decode references, the ragged kernel over
    every row (tuned blocks) and the public entry (which sends such rows to the decode
    kernel) must agree."""
    q, (k, v, ks, vs), md = make_ragged(2, 16, 4, 128, "fp8", [1, 1, 1, 0], 4)
    scale = 128 ** -0.5
    dec = paged_attention_reference(q, k, v, 0, md.seq_lens, md.page_table, ks, vs,
                                    sm_scale=scale)
    kernel = ragged_paged_attention_blocks(q, k, v, 0, md, ks, vs, sm_scale=scale,
                                           interpret=interpret,
                                           blocks=tuning.ragged_blocks(1, 128, 16))
    out = ragged_paged_attention(q, k, v, 0, md, ks, vs, sm_scale=scale, interpret=interpret)
    for got in (kernel, out):
        assert rel_err(got[:3], dec[:3]) < 1e-2
        np.testing.assert_array_equal(np.asarray(got[3], np.float32), 0.0)


def pallas_calls(jaxpr) -> set:
    """Names of the Pallas kernels a jaxpr calls, through nested jits."""
    names = set()
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            names.add(e.params["name"])
        elif "jaxpr" in e.params:                                      # a nested jit
            inner = e.params["jaxpr"]
            names |= pallas_calls(getattr(inner, "jaxpr", inner))
    return names


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_mixed_step_splits_decode_rows_off(kv_dtype, interpret):
    """A mixed step (decode rows between prefill chunks, a padded row, padding tokens): the
    public entry runs both kernels and matches the reference token for token."""
    q_lens = [1, 9, 1, 0, 17, 1]
    q, (k, v, ks, vs), md = make_ragged(37, 16, 4, 128, kv_dtype, q_lens, 32)
    args = (q, k, v, jnp.int32(1), md, ks, vs)
    fn = functools.partial(ragged_paged_attention, sm_scale=128 ** -0.5, interpret=interpret)
    decode = "jaxinfer_paged_decode" + ("_pairs" if kv_dtype == "fp8" else "")  # f16pairs
    # the decode rows' context is split (pallas_kernels/tuning.py), so their combine runs too
    assert pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr) == {
        decode, "jaxinfer_paged_decode_combine", "jaxinfer_ragged_paged_attention"}
    out = fn(*args)
    ref = ragged_paged_attention_reference(*args, sm_scale=128 ** -0.5)
    assert row_rel_err(out[:29], ref[:29]) < 1e-2
    np.testing.assert_array_equal(np.asarray(out[29:], np.float32), 0.0)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("q_mag,compute", [(2e5, HF), (1e-6, HF), (2e5, PR)])
def test_fp8_scale_stress(q_mag, compute, interpret):
    """The f16 path's range corners (tests/kernels/test_paged_attention.py's stress_cache, wide V
    scales) with causal chunks: every token's own relative error."""
    q, (k, _, _, _), md = make_ragged(23, 16, 4, 128, "fp8", [12, 1, 0, 5], 20)
    q, (k, v, ks, vs) = stress_cache(np.random.default_rng(29), q, k.shape, "wide_v", q_mag)
    args = (q, k, v, jnp.int32(1), md, ks, vs)
    out = ragged_paged_attention_blocks(*args, sm_scale=128 ** -0.5, interpret=interpret,
                                        blocks=RaggedBlocks(8, 32, 4, 2, compute))
    ref = ragged_paged_attention_reference(*args, sm_scale=128 ** -0.5)
    assert row_rel_err(out, ref) < 4e-3
    np.testing.assert_array_equal(np.asarray(out[18:]), 0.0)
