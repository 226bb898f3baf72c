import sys, jax, jax.numpy as jnp
from pallas_kernels import swiglu_quant as sq
m = int(sys.argv[1]); f = 14336
y = jax.random.normal(jax.random.PRNGKey(0), (m, 2 * f), jnp.bfloat16) * 4
xs = jnp.full((m, 1), 0.01, jnp.float32); ws = jnp.ones((2 * f,), jnp.float32)
for _ in range(3):
    q, s = sq.swiglu_quant(y, xs, ws)
jax.block_until_ready(q); print("M", m, sq.TILES, q.shape)
