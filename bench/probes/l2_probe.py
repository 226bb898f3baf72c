"""One-off: does an L2 prefetch ahead of an FP8 GEMV's weight pay? (device probe)"""
import sys, time, json, os
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jaxinfer import ops
from pallas_kernels import l2_prefetch as lp

L = 8
K, N = 4096, 28672
rng = np.random.default_rng(0)
ws = [jnp.asarray(rng.standard_normal((N, K), np.float32) * 0.05).astype(jnp.float8_e4m3fn) for _ in range(L)]
scales = [jnp.ones((N,), jnp.float32) * 0.01 for _ in range(L)]
x0 = jnp.asarray(rng.standard_normal((8, K)), jnp.bfloat16)

def idle(x, k):
    for _ in range(k):
        xf = x.astype(jnp.float32)
        x = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + 1e-6)).astype(x.dtype)
        x = lax.optimization_barrier(x)
    return x

def make(nbytes, programs, chunk, k_idle):
    def f(x, ws, scales):
        for l in range(L):
            if nbytes:
                x = lp.prefetch(x, [ws[l]], (nbytes,), programs=programs, max_chunk=chunk)
            x = idle(x, k_idle)
            y = ops.linear(x, ws[l], scales[l])
            x = (y[:, :K].astype(jnp.float32) * 0.01 + x.astype(jnp.float32)).astype(jnp.bfloat16)
        return x
    return jax.jit(f)

def timeit(f, reps=30):
    y = f(x0, ws, scales); y.block_until_ready()
    y = f(x0, ws, scales); y.block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        y = f(x0, ws, scales)
    y.block_until_ready()
    return (time.perf_counter() - t) / reps / L * 1e6

rows = []
cases = [(0, 0, 0, 0), (0, 0, 0, 4)]
for k_idle in (0, 4):
    cases.append((4096, 132, 4096, k_idle))
for nb in (16, 32):
    for programs in (8, 132, 528):
        for chunk in (4096, 65536):
            cases.append((nb << 20, programs, chunk, 4))
for nb, programs, chunk, k_idle in cases:
    try:
        us = timeit(make(nb, programs, chunk, k_idle))
    except Exception as e:
        print("FAIL", nb, programs, chunk, k_idle, repr(e)[:300]); continue
    r = dict(prefetch_MB=nb / 2**20, programs=programs, chunk=chunk, idle_kernels=k_idle, us_per_layer=round(us, 2))
    rows.append(r); print(r, flush=True)
out = os.environ.get("OUT", ".")
json.dump(rows, open(f"{out}/l2_probe.json", "w"), indent=1)
