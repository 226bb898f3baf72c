"""lora_layers.delta's two forms (slots gathered for T <= N, every slot masked for T > N)
against a per-token numpy reference on random data."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import lora_layers


@pytest.mark.parametrize("tokens", [1, 4, 5, 9])
def test_each_token_gets_its_own_slot_s_update(tokens):
    rng = np.random.default_rng(tokens)
    din, dout, n, r = 12, 10, 4, 3
    a = rng.standard_normal((din, n, r)).astype(np.float32)
    b = rng.standard_normal((n, r, dout)).astype(np.float32)
    x = rng.standard_normal((tokens, din)).astype(np.float32)
    index = rng.integers(-1, n, tokens).astype(np.int32)
    index[0] = -1
    got = np.asarray(lora_layers.delta(jnp.asarray(x), (jnp.asarray(a), jnp.asarray(b)),
                                       jnp.asarray(index)))
    want = np.stack([np.zeros(dout, np.float32) if s < 0 else x[t] @ a[:, s] @ b[s]
                     for t, s in enumerate(index)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
