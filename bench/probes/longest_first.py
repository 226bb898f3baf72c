"""Decode attention with the rows longest first vs in grid order, at equal lengths and at
lengths spread 0.5-1.5x the mean (same mean), FP8 and bf16 KV, B = 64 / 256 / 512: device
time per call (bench.kernels.time_impl). H200 runs: bench/results/history/
longest_first_probe.json, and masked_loads_*_probe.json (grid order only, one process per
JAXINFER_MASKED_LOADS setting). Usage on the GPU, from the repository root:
OUT=dir [PROBE_GRID_ORDER_ONLY=1] [PROBE_NAME=name] python -m bench.probes.longest_first
(on the CPU it runs one tiny shape in interpret mode)."""
import json, os
import jax, jax.numpy as jnp
from bench import kernels as bk
from pallas_kernels import tuning
from bench.probes.page_size import lengths

rows = []
LF = (False,) if os.environ.get("PROBE_GRID_ORDER_ONLY") else (False, True)
GPU = jax.default_backend() == "gpu"
BM = ((64, 2048), (256, 1536), (512, 1536)) if GPU else ((4, 64),)
key = jax.random.PRNGKey(0)
for fp8 in (True, False):
    for batch, mean in BM:
        ctx = mean * 3 // 2
        case = bk.make_case(batch, ctx, fp8, key)
        q, k, v, sc, tables, _ = case
        for kind in ("equal", "spread"):
            lens = lengths(batch, mean, kind == "spread", ctx)
            blk = bk.tuned_blocks(batch, ctx, fp8)
            for lf in LF:
                fn = bk.decode_with(blk, longest_first=lf, interpret=not GPU)
                wall, dev = bk.time_impl(fn, (q, k, v, sc, tables, jnp.asarray(lens)))
                nbytes = bk.kv_bytes(int(lens.sum()), fp8)
                r = dict(kv="fp8" if fp8 else "bf16", batch=batch, mean=mean, lens=kind,
                         longest_first=lf, **bk.timing(wall, dev, nbytes),
                         max_len=int(lens.max()), min_len=int(lens.min()), blocks=str(blk),
                         masked_loads_min_programs=tuning.MASKED_LOADS_MIN_PROGRAMS)
                rows.append(r)
                print({k: r[k] for k in ("kv", "batch", "lens", "longest_first", "us", "us_device",
                                        "TBps_device")}, flush=True)
json.dump(rows, open(os.environ.get("OUT", ".") + "/" + os.environ.get("PROBE_NAME", "lpt_probe")
                     + ".json", "w"), indent=1)
