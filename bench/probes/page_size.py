"""Decode attention at KV page sizes 16 / 32 / 64 / 128 tokens (the engine's default is 16):
device time per call (bench.kernels.time_impl) of the tuned kernel, as the model calls it
(blocks of max(table entry, page) tokens, the masked-loads rule, grid order), on issue 3's
shapes (B=64 S=2048 and B=1 S=32768, equal lengths) and the throughput run's decode shapes
(B=256 / 512, lengths 0.5-1.5x a mean of 1536), FP8 and bf16 KV. Page sizes are interleaved
within each shape and the whole sweep runs PROBE_PASSES times (default 2), so drift shows.
Usage on the GPU, from the repository root:
OUT=dir [PROBE_PAGES=16,64] [PROBE_PASSES=2] python -m bench.probes.page_size
(on the CPU it runs one tiny shape in interpret mode)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernels as bk
from pallas_kernels import tuning

GPU = jax.default_backend() == "gpu"
PAGES = [int(x) for x in os.environ.get("PROBE_PAGES", "16,32,64,128").split(",")]
PASSES = int(os.environ.get("PROBE_PASSES", "2"))
# (fp8, batch, mean length, spread)
SHAPES = ([(True, 64, 2048, False), (False, 64, 2048, False), (True, 1, 32768, False),
           (True, 256, 1536, True), (True, 512, 1536, True), (False, 256, 1536, True)]
          if GPU else [(True, 4, 64, True)])


def lengths(batch: int, mean: int, spread: bool, ctx: int) -> np.ndarray:
    if not spread:
        return np.full(batch, mean, np.int32)
    x = np.random.default_rng(batch).uniform(0.5, 1.5, batch)
    return np.clip(np.round(x / x.mean() * mean), 1, ctx).astype(np.int32)


def main() -> None:
    rows, key = [], jax.random.PRNGKey(0)
    for rep in range(PASSES):
        for fp8, batch, mean, spread in SHAPES:
            ctx = mean * 3 // 2 if spread else mean
            lens = lengths(batch, mean, spread, ctx)
            for page in PAGES:
                q, k, v, sc, tables, _ = bk.make_case(batch, ctx, fp8, key, page=page)
                blk = bk.tuned_blocks(batch, ctx, fp8, page=page)
                fn = bk.decode_with(blk, interpret=not GPU)
                wall, dev = bk.time_impl(fn, (q, k, v, sc, tables, jnp.asarray(lens)))
                r = dict(kv="fp8" if fp8 else "bf16", batch=batch, mean=mean,
                         lens="spread" if spread else "equal", page=page, rep=rep,
                         **bk.timing(wall, dev, bk.kv_bytes(int(lens.sum()), fp8)),
                         blocks=str(blk),
                         masked_loads_min_programs=tuning.MASKED_LOADS_MIN_PROGRAMS)
                rows.append(r)
                print({x: r[x] for x in ("kv", "batch", "lens", "page", "rep", "us",
                                         "us_device", "TBps_device")}, flush=True)
                del q, k, v, sc, tables
    out = os.path.join(os.environ.get("OUT", "."), "page_size_probe.json")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
