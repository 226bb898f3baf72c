"""Where the decode kernel's outputs go: padding rows after the real ones (`rows`), token
rows of a mixed step's arrays written in place (`token_rows`/`out`), and the split combine
that merges partials into them. Cases and tolerances: tests/kernels/test_paged_attention.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (paged_attention, paged_attention_blocks,
                                            paged_attention_reference)
from pallas_kernels.tuning import DecodeBlocks
from test_paged_attention import BF, MODES, PR, make_decode, rel_err, row_rel_err


@pytest.mark.parametrize("splits", [1, 3, 40])
@pytest.mark.parametrize("interpret", MODES)
def test_real_rows_then_padding(splits, interpret):
    """`rows`: only q's first rows are real (a decode step padded on the device). Those rows
    match the reference on them alone, the padding rows come out zeros, with the context
    split (the combine kernel pads; 40 splits: more than one of its chunks of 32) or not."""
    page_size = 8
    q, (k, v, ks, vs), lens, table, _ = make_decode(11, page_size, 4, 64, "bf16")
    real = 3
    lens = lens.at[real:].set(0)              # padding rows as pad_decode_rows makes them
    table = table.at[real:].set(0)
    scale = 64 ** -0.5
    blocks = DecodeBlocks(16, splits, 4, 2)
    got = paged_attention_blocks(q, k, v, jnp.int32(0), lens, table, ks, vs, sm_scale=scale,
                                 interpret=interpret, blocks=blocks, rows=real)
    want = paged_attention_reference(q[:real], k, v, jnp.int32(0), lens[:real], table[:real],
                                     sm_scale=scale)
    assert got.shape == q.shape
    assert rel_err(got[:real], want) < 1e-2
    np.testing.assert_array_equal(np.asarray(got[real:], np.float32), 0.0)
    # the public entry picks the split for the real rows and gives the same
    pub = paged_attention(q, k, v, jnp.int32(0), lens, table, sm_scale=scale,
                          interpret=interpret, rows=real)
    assert rel_err(pub[:real], want) < 1e-2
    np.testing.assert_array_equal(np.asarray(pub[real:], np.float32), 0.0)
    with pytest.raises(ValueError, match="rows"):
        paged_attention_blocks(q, k, v, jnp.int32(0), lens, table, sm_scale=scale,
                               interpret=True, blocks=blocks, rows=q.shape[0] + 1)


@pytest.mark.parametrize("kv_dtype,compute,splits", [("bf16", BF, 1), ("bf16", BF, 3),
                                                     ("fp8s", PR, 1), ("fp8", PR, 2)])
@pytest.mark.parametrize("interpret", MODES)
def test_token_rows_write_into_out(kv_dtype, compute, splits, interpret):
    """token_rows + out (the ragged path's decode rows): row b reads q at token
    token_rows[b] of a token array and writes its output into that row of out, in place;
    rows marked -1 write nothing, and out's other rows keep their values (split or not)."""
    case = make_decode(17, 16, 4, 128, kv_dtype)
    q_rows, (k, v, ks, vs), lens, table, _ = case
    batch, tokens = q_rows.shape[0], 12
    trows = np.array([3, 0, 11, -1, 7, 5, -1])[:batch]          # -1: not a decode row
    rng = np.random.default_rng(3)
    q = np.asarray(rng.standard_normal((tokens,) + q_rows.shape[1:]), np.float32)
    q[trows[trows >= 0]] = np.asarray(q_rows, np.float32)[trows >= 0]
    q = jnp.asarray(q, jnp.bfloat16)
    out = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)     # the "ragged" output
    scale = 128 ** -0.5
    args = (q, k, v, jnp.int32(1), lens, table, ks, vs)
    got = paged_attention_blocks(*args, sm_scale=scale, interpret=interpret,
                                 blocks=DecodeBlocks(32, splits, 4, 2, compute, True),
                                 token_rows=jnp.asarray(trows, jnp.int32), out=out)
    want = paged_attention_reference(q_rows, k, v, jnp.int32(1), lens, table, ks, vs,
                                     sm_scale=scale)
    live = trows >= 0
    assert got.shape == q.shape
    assert row_rel_err(got[trows[live]], want[live]) < 1e-2
    untouched = np.setdiff1d(np.arange(tokens), trows[live])
    np.testing.assert_array_equal(np.asarray(got[untouched]), np.asarray(out[untouched]))
    with pytest.raises(ValueError, match="token_rows"):
        paged_attention_blocks(*args, sm_scale=scale, interpret=True,
                               blocks=DecodeBlocks(32, 1, 4, 2), token_rows=jnp.asarray(trows))


@pytest.mark.parametrize("live", [False, True])
@pytest.mark.parametrize("splits,rows,batch", [(3, 2, 2), (40, 2, 5), (64, 1, 8)])
def test_combine_kernel_matches_reference(splits, rows, batch, live):
    """The split combine kernel against its plain-jnp reference on random partials, empty
    splits included (max M_INIT, sum 0: they weigh nothing), more splits than one chunk
    holds (40, 64), and padding rows past `rows` written as zeros; with a live mask (the
    ragged kernel's split path) the rows it leaves out are zeros too."""
    from pallas_kernels.attention_block import M_INIT
    from pallas_kernels.split_combine import _combine, combine_call
    rng = np.random.default_rng(splits)
    heads, d = 4, 64
    acc = rng.standard_normal((splits, rows, heads, d)).astype(np.float32)
    m = rng.uniform(-5, 5, (splits, rows, heads)).astype(np.float32)
    l = rng.uniform(0.5, 3, (splits, rows, heads)).astype(np.float32)
    empty = rng.random((splits, rows, heads)) < 0.3
    m[empty], l[empty], acc[empty] = M_INIT, 0.0, 0.0
    want = np.asarray(_combine(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l)))
    mask = (np.arange(batch) < rows) & (np.arange(batch) % 2 == 0 if live else True)
    got = combine_call(jnp.asarray(acc.reshape(-1, d)), jnp.asarray(m.reshape(-1)),
                       jnp.asarray(l.reshape(-1)), splits=splits, rows=rows, batch=batch,
                       num_heads=heads, head_dim=d, dtype=jnp.float32, interpret=True,
                       live=jnp.asarray(mask, jnp.int32) if live else None)
    got = np.asarray(got).reshape(batch, heads, d)
    np.testing.assert_allclose(got[:rows][mask[:rows]], want[mask[:rows]], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(got[~mask], 0.0)
