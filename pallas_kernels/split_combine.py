"""The split decode's combine: the partial results of a context split over several programs
(each split's unnormalized accumulator and its base-2 running max and sum) merged into one
output row per (row, q head). The decode kernel (paged_attention.py) and the ragged kernel's
split path (ragged_paged_attention.py) call it; `_combine` is its plain-jnp reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import pow2_ceil, triton_params


def _combine(acc, m, l):
    """Merge split partials (the combine kernel's reference): acc [N, B, H, D], m/l [N, B, H]
    (base-2 max) -> [B, H, D]."""
    w = jnp.exp2(m - jnp.max(m, axis=0, keepdims=True))
    denom = jnp.sum(w * l, axis=0)
    out = jnp.sum(w[..., None] * acc, axis=0)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


COMBINE_CHUNK = 32    # splits the combine holds at once ([chunk, D] f32 per program)


def _combine_kernel(*refs, splits: int, rows: int, num_heads: int, head_dim: int,
                    live: bool, token_rows: bool = False):
    """_combine for one (row, q head): acc [N * rows * H, D], m/l [N * rows * H] -> o row
    b * H + h. Rows >= `rows` (padding) get zeros; with `live` (the ragged kernel's split
    path) a first ref live [rows] i32 says which rows the partials cover, the others get
    zeros. With `token_rows` a first ref trows [rows] i32 names each row's output row
    instead (-1: none written), into an output aliased to an input (its ref is skipped)."""
    b, h = pl.program_id(0), pl.program_id(1)
    if token_rows:
        trows_ref, acc_ref, m_ref, l_ref, _, o_ref = refs
        out_row = jnp.maximum(trows_ref[b], 0) * num_heads + h
        real = trows_ref[b] >= 0
    else:
        live_ref, (acc_ref, m_ref, l_ref, o_ref) = (refs[0], refs[1:]) if live else (None,
                                                                                      refs)
        out_row = b * num_heads + h
        real = (b < rows) if live_ref is None else (live_ref[b] != 0)

        @pl.when(jnp.logical_not(real))
        def _():
            o_ref[pl.ds(out_row, 1), :] = jnp.zeros((1, head_dim), o_ref.dtype)

    @pl.when(real)
    def _():
        chunk = min(COMBINE_CHUNK, pow2_ceil(splits))
        parts = [jnp.arange(c, c + chunk, dtype=jnp.int32) for c in range(0, splits, chunk)]
        idx = [(jnp.minimum(s, splits - 1) * rows + b) * num_heads + h for s in parts]
        ms = [jnp.where(s < splits, m_ref[i], -jnp.inf) for s, i in zip(parts, idx)]
        top = functools.reduce(jnp.maximum, [jnp.max(m) for m in ms])
        denom = jnp.zeros((), jnp.float32)
        out = jnp.zeros((1, head_dim), jnp.float32)
        for s, i, m in zip(parts, idx, ms):
            w = jnp.exp2(m - top)                          # 0 past the last split
            denom = denom + jnp.sum(w * l_ref[i])
            out = out + jnp.sum(w[:, None] * acc_ref[i], axis=0, keepdims=True)
        o_ref[pl.ds(out_row, 1), :] = (out / jnp.where(denom > 0, denom, 1.0)
                                        ).astype(o_ref.dtype)


def combine_call(acc, m, l, *, splits: int, rows: int, batch: int, num_heads: int,
                 head_dim: int, dtype, interpret: bool, live=None, token_rows=None, out=None,
                 name: str = "jaxinfer_paged_decode_combine"):
    """The split partials merged into [batch * H, D] (_combine_kernel); live [rows] (or
    None): which rows the partials cover. token_rows [rows] (with out [N * H, D]): row b's
    result goes to out's row token_rows[b] (-1: nowhere), out updated in place, the rest of
    it kept."""
    kernel = functools.partial(_combine_kernel, splits=splits, rows=rows, num_heads=num_heads,
                               head_dim=head_dim, live=live is not None,
                               token_rows=token_rows is not None)
    if token_rows is not None:
        return pl.pallas_call(
            kernel, grid=(rows, num_heads), interpret=interpret,
            out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={4: 0},
            name=name, **triton_params(interpret, 1, 1),
        )(token_rows, acc, m, l, out)
    return pl.pallas_call(
        kernel, grid=(batch, num_heads), interpret=interpret,
        out_shape=jax.ShapeDtypeStruct((batch * num_heads, head_dim), dtype),
        name=name, **triton_params(interpret, 1, 1),
    )(*(() if live is None else (live,)), acc, m, l)
