"""Why the FP8 decode kernel is slower inside the model's step (332 us per layer at B=384
S=1536, profile_b384_fp8.json) than alone (300-305 us, bench.kernels --tune and
bench/probes/page_tables.py). Device time per call of the tuned kernel, B=384 S=1536, equal
lengths, each row's pages contiguous, over three caches:
  layers    32 layers, one call per layer, as the model calls it (18 GiB per K)
  big       one layer of > 4 GiB per K (pages past the ones read), page-table sets rotated
  small     one layer of ~1.1 GiB per K (bench.kernels' case), page-table sets rotated
Pallas's Triton lowering computes a gather's element offsets in 64-bit integers when the
array holds >= 2**32 bytes (jax/_src/pallas/triton/lowering.py,
_compute_offsets_from_indices): the model's cache and `big` get [128, 64] i64 offset tensors
per K/V block, `small` i32 ones (the Triton IR lowered for CUDA on the CPU, eighteenth
session). `big` vs `small` isolates that; `layers` vs `big` the rest.
Usage on the GPU, from the repository root: OUT=dir python -m bench.probes.layers
(on the CPU it runs tiny shapes in interpret mode). Written in the eighteenth session; run
in the nineteenth (H200, f1096bc; bench/results/history/layers_probe_f1096bc.json): layers
320.8 / 320.4, big 322.8 / 322.3, small 300.5 / 299.3 us. The array's size, not the layer
count: hence kv_cache.KVLayers."""
import json
import os

import jax
import jax.numpy as jnp

from bench import kernels as bk
from bench.probes.page_tables import contiguous
from bench.profile import device_seconds
from jaxinfer.kv_cache import FP8_DTYPE

GPU = jax.default_backend() == "gpu"
BATCH, CTX, LAYERS = (384, 1536, 32) if GPU else (2, 64, 2)
BIG_PAGES = (1 << 32) // (bk.HKV * bk.PAGE * bk.D) + 4096 if GPU else 64   # > 4 GiB per K


def cache(layers: int, pages: int):
    """K, V and their scales filled with constants (the values do not change the time)."""
    shape = (layers, bk.HKV, pages, bk.PAGE, bk.D)
    scale = jnp.full(shape[:-1], 1 / 16, jnp.float32)
    return jnp.full(shape, 0.5, FP8_DTYPE), jnp.full(shape, 0.25, FP8_DTYPE), scale, scale


def main() -> None:
    rows = []
    pps = CTX // bk.PAGE
    blk = bk.tuned_blocks(BATCH, CTX, True)
    q = jax.random.normal(jax.random.PRNGKey(0), (BATCH, bk.HQ, bk.D), jnp.bfloat16)
    lens = jnp.full((BATCH,), CTX, jnp.int32)

    attend = [bk.decode_with(blk, i, interpret=not GPU) for i in range(LAYERS)]
    one = attend[0]

    def record(name, k, dev, rep):
        rows.append(dict(cache=name, gib_per_k=round(k.size * k.dtype.itemsize / 2**30, 2),
                         rep=rep, us_device=round(dev * 1e6, 1) if dev else None))
        print(rows[-1], flush=True)

    k, v, ks, vs = cache(LAYERS, 1 + BATCH * pps)
    table = contiguous(jnp.zeros((1, BATCH, pps), jnp.int32))[0]
    every_layer = jax.jit(lambda *args: [f(*args) for f in attend])
    for rep in range(2):
        record("layers", k, device_seconds(
            lambda: every_layer(q, k, v, ks, vs, table, lens), LAYERS), rep)
    del k, v, ks, vs
    _, k1, v1, sc, tables, _ = bk.make_case(BATCH, CTX, True, jax.random.PRNGKey(0))
    tables = contiguous(tables)
    for rep in range(2):
        record("small", k1, bk.time_impl(one, (q, k1, v1, sc, tables, lens))[1], rep)
    del k1, v1, sc
    k, v, ks, vs = cache(1, max(BIG_PAGES, 1 + tables.size))
    for rep in range(2):
        record("big", k, bk.time_impl(one, (q, k, v, (ks, vs), tables, lens))[1], rep)
    with open(os.path.join(os.environ.get("OUT", "."), "layers_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
