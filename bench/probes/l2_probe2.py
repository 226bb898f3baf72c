"""One-off: how fast is an FP8 GEMV whose weight is in L2; does a line prefetch help?"""
import time, json, os
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jaxinfer import ops
from pallas_kernels import l2_prefetch as lp

L = 8
rng = np.random.default_rng(0)
def mk(n, k):
    return jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.05).astype(jnp.float8_e4m3fn)
wo = [mk(4096, 4096) for _ in range(L)]
wo2 = [mk(4096, 4096) for _ in range(L)]
wg = [mk(28672, 4096) for _ in range(L)]
s1 = jnp.ones((4096,), jnp.float32) * 0.01
sg = jnp.ones((28672,), jnp.float32) * 0.01
x0 = jnp.asarray(rng.standard_normal((8, 4096)), jnp.bfloat16)

def idle(x, k):
    for _ in range(k):
        xf = x.astype(jnp.float32)
        x = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + 1e-6)).astype(x.dtype)
        x = lax.optimization_barrier(x)
    return x

def nxt(y, x):
    return (y[:, :4096].astype(jnp.float32) * 0.01 + x.astype(jnp.float32)).astype(jnp.bfloat16)

def run(body, reps=30):
    f = jax.jit(lambda x, ws: body(x, ws))
    args = (x0, (wo, wo2, wg))
    f(*args).block_until_ready(); f(*args).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        y = f(*args)
    y.block_until_ready()
    return round((time.perf_counter() - t) / reps / L * 1e6, 2)

def o_twice(same):
    def body(x, ws):
        wo, wo2, _ = ws
        for l in range(L):
            x = idle(x, 2)
            x = nxt(ops.linear(x, wo[l], s1), x)
            x = nxt(ops.linear(x, wo[l] if same else wo2[l], s1), x)
        return x
    return body

def gate(nb, mode, programs, k_idle=4):
    def body(x, ws):
        _, _, wg = ws
        for l in range(L):
            if nb:
                x = lp.prefetch(x, [wg[l]], (nb,), programs=programs, lines=(mode == "line"))
            x = idle(x, k_idle)
            x = nxt(ops.linear(x, wg[l], sg), x)
        return x
    return body

rows = []
def rec(name, thunk, **kw):
    try:
        us = thunk()
    except Exception as e:
        print("FAIL", name, kw, repr(e)[:400], flush=True); return
    r = dict(case=name, us_per_layer=us, **kw); rows.append(r); print(r, flush=True)
rec("O then O, different weights", lambda: run(o_twice(False)))
rec("O then O, same weight (2nd from L2)", lambda: run(o_twice(True)))
rec("gate/up, 4 idle", lambda: run(gate(0, "", 0)))
for nb in (4, 16):
    for programs in (132, 264):
        rec("gate/up, line prefetch", lambda: run(gate(nb << 20, "line", programs)), MB=nb, programs=programs)
rec("gate/up, bulk 16MB/132", lambda: run(gate(16 << 20, "bulk", 132)), MB=16, programs=132)
rec("gate/up, bulk 16MB/132, 12 idle", lambda: run(gate(16 << 20, "bulk", 132, 12)), MB=16, programs=132)
rec("gate/up, 12 idle", lambda: run(gate(0, "", 0, 12)))
json.dump(rows, open(os.environ.get("OUT", ".") + "/l2_probe2.json", "w"), indent=1)
