"""FP8 decode attention over a 32-layer cache, one call per layer (as the model's step
calls it), vs bench.kernels' one-layer cache with rotating page tables: device time per call
of the tuned kernel, B=384 S=1536 (equal lengths), each row's pages contiguous. Asked by the
eighteenth session (the kernel alone 300-305 us, in the model's step 332 us per layer).
Usage on the GPU, from the repository root: OUT=dir python -m bench.probes.layers
(on the CPU it runs one tiny shape in interpret mode)."""
import json
import os

import jax
import jax.numpy as jnp

from bench import kernels as bk
from bench.probes.page_tables import contiguous
from bench.profile import device_seconds
from jaxinfer.kv_cache import FP8_DTYPE
from pallas_kernels.paged_attention import paged_attention_blocks

GPU = jax.default_backend() == "gpu"
BATCH, CTX, LAYERS = (384, 1536, 32) if GPU else (2, 64, 2)


def main() -> None:
    rows = []
    pps = CTX // bk.PAGE
    blk = bk.tuned_blocks(BATCH, CTX, True)
    q = jax.random.normal(jax.random.PRNGKey(0), (BATCH, bk.HQ, bk.D), jnp.bfloat16)
    lens = jnp.full((BATCH,), CTX, jnp.int32)

    def attend(q, k, v, ks, vs, t, n, layer):
        return paged_attention_blocks(q, k, v, layer, n, t, ks, vs, sm_scale=bk.D ** -0.5,
                                      blocks=blk, interpret=not GPU)

    # the model's way: one cache of LAYERS layers, one call per layer, one page table
    shape = (LAYERS, bk.HKV, 1 + BATCH * pps, bk.PAGE, bk.D)
    k = jnp.full(shape, 0.5, FP8_DTYPE)
    v = jnp.full(shape, 0.25, FP8_DTYPE)
    ks = vs = jnp.full(shape[:-1], 1 / 16, jnp.float32)
    table = contiguous(jnp.zeros((1, BATCH, pps), jnp.int32))[0]
    every_layer = jax.jit(lambda q, k, v, ks, vs, t, n: [attend(q, k, v, ks, vs, t, n, i)
                                                          for i in range(LAYERS)])
    for rep in range(2):
        dev = device_seconds(lambda: every_layer(q, k, v, ks, vs, table, lens), LAYERS)
        rows.append(dict(cache="layers", layers=LAYERS, rep=rep,
                         us_device=round(dev * 1e6, 1) if dev else None))
        print(rows[-1], flush=True)
    del k, v, ks, vs
    # bench.kernels' way: a one-layer cache, page-table sets rotated
    q1, k1, v1, sc, tables, _ = bk.make_case(BATCH, CTX, True, jax.random.PRNGKey(0))
    fn = lambda q, k, v, ks, vs, t, n: attend(q, k, v, ks, vs, t, n, 0)  # noqa: E731
    for rep in range(2):
        _, dev = bk.time_impl(fn, (q, k1, v1, sc, contiguous(tables), lens))
        rows.append(dict(cache="one layer", layers=1, rep=rep,
                         us_device=round(dev * 1e6, 1) if dev else None))
        print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "layers_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
