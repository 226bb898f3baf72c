"""FP8 decode attention over page tables of random pages (bench.kernels' case) vs each row's
pages in one contiguous run (the decode harness's tables, bench.common.decode_input), equal
lengths: device time per call of the tuned kernel. Asked by the eighteenth session: the
kernel took 304.6 us per call at B=384 S=1536 in bench.kernels --tune (random pages), and
332 us per layer inside the model's decode step (profile_b384_fp8.json, contiguous pages).
Usage on the GPU, from the repository root: OUT=dir python -m bench.probes.page_tables
(on the CPU it runs one tiny shape in interpret mode)."""
import json
import os

import jax
import jax.numpy as jnp

from bench import kernels as bk

GPU = jax.default_backend() == "gpu"
SHAPES = [(384, 1536), (512, 1536), (64, 2048)] if GPU else [(2, 64)]


def contiguous(tables):
    """The same number of page-table sets, row b of set r on pages 1 + (r*B + b)*n ..."""
    rot, batch, n = tables.shape
    return (1 + jnp.arange(rot * batch * n, dtype=jnp.int32)).reshape(rot, batch, n)


def main() -> None:
    rows = []
    for rep in range(2):
        for batch, ctx in SHAPES:
            q, k, v, sc, tables, lens = bk.make_case(batch, ctx, True, jax.random.PRNGKey(0))
            blk = bk.tuned_blocks(batch, ctx, True)
            fn = bk.decode_with(blk, interpret=not GPU)
            for kind, t in (("random", tables), ("contiguous", contiguous(tables))):
                wall, dev = bk.time_impl(fn, (q, k, v, sc, t, lens))
                r = dict(batch=batch, context=ctx, tables=kind, rep=rep,
                         **bk.timing(wall, dev, bk.kv_bytes(batch * ctx, True)))
                rows.append(r)
                print(r, flush=True)
            del q, k, v, sc, tables
    with open(os.path.join(os.environ.get("OUT", "."), "page_tables_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
