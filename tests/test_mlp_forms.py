"""bench/probes/mlp_forms.py: its reordered weight layouts compute the same MLP as today's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.probes import mlp_forms as mf


@pytest.mark.parametrize("t", [16, 64])
def test_forms_match_current_route(t):
    e, f = 64, 256
    (ws,) = mf.make_sets(jax.random.PRNGKey(0), e, f, 1)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, e), jnp.bfloat16)
    r = jnp.zeros((8, e), jnp.bfloat16)     # the residual would hide the MLP's part
    want = np.asarray(mf.cur(x, r, *ws), np.float32)
    got = {"blk": mf.blocked(t)(x, r, *mf.interleave(ws, t)),
           "bat": mf.batched(x, r, *mf.stack2(ws)),
           "split": mf.split(4)(x, r, *ws)}
    for name, y in got.items():
        y = np.asarray(y, np.float32)
        assert np.linalg.norm(y - want) <= 1e-2 * np.linalg.norm(want), name
    # a wrong interleave (blocks of another size) must not pass
    bad = np.asarray(mf.blocked(t)(x, r, *mf.interleave(ws, t // 2)), np.float32)
    assert np.linalg.norm(bad - want) > 1e-1 * np.linalg.norm(want)
