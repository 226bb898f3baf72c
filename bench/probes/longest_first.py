"""Decode attention with the rows longest first vs in grid order, at equal lengths and at
lengths spread 0.5-1.5x the mean (same mean), FP8 and bf16 KV, B = 64 / 256 / 512: device
time per call (bench.kernels.time_impl). H200 runs: bench/results/history/
longest_first_probe.json, and masked_loads_*_probe.json (grid order only, one process per
JAXINFER_MASKED_LOADS setting). Usage on the GPU, from the repository root:
OUT=dir [PROBE_GRID_ORDER_ONLY=1] [PROBE_NAME=name] python -m bench.probes.longest_first
(on the CPU it stops at the first kernel)."""
import json, os
import jax, jax.numpy as jnp, numpy as np
from bench import kernels as bk
from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import paged_attention_blocks

rows = []
LF = (False,) if os.environ.get("PROBE_GRID_ORDER_ONLY") else (False, True)
BM = ((64, 2048), (256, 1536), (512, 1536)) if jax.default_backend() == "gpu" else ((4, 64),)
key = jax.random.PRNGKey(0)
for fp8 in (True, False):
    for batch, mean in BM:
        ctx = mean * 3 // 2
        case = bk.make_case(batch, ctx, fp8, key)
        q, k, v, sc, tables, _ = case
        rng = np.random.default_rng(batch)
        spread = rng.uniform(0.5, 1.5, batch)
        spread = np.clip(np.round(spread / spread.mean() * mean), 1, ctx).astype(np.int32)
        for kind, lens in (("equal", np.full(batch, mean, np.int32)), ("spread", spread)):
            blk = bk.tuned_blocks(batch, ctx, fp8)
            for lf in LF:
                fn = (lambda lf, blk: lambda q, k, v, ks, vs, t, n: paged_attention_blocks(
                    q, k, v, 0, n, t, ks, vs, sm_scale=bk.D ** -0.5, blocks=blk,
                    longest_first=lf))(lf, blk)
                c = (q, k, v, sc, tables, jnp.asarray(lens))
                wall, dev = bk.time_impl(fn, c)
                tokens = int(lens.sum())
                nbytes = tokens * bk.HKV * (bk.D * (1 if fp8 else 2) + (4 if fp8 else 0)) * 2
                r = dict(kv="fp8" if fp8 else "bf16", batch=batch, mean=mean, lens=kind,
                         longest_first=lf, us=round(wall * 1e6, 1),
                         us_device=round(dev * 1e6, 1) if dev else None,
                         TBps_device=round(nbytes / dev / 1e12, 3) if dev else None,
                         max_len=int(lens.max()), min_len=int(lens.min()), blocks=str(blk),
                         masked_loads_min_programs=pa.MASKED_LOADS_MIN_PROGRAMS)
                rows.append(r)
                print({k: r[k] for k in ("kv", "batch", "lens", "longest_first", "us", "us_device",
                                        "TBps_device")}, flush=True)
json.dump(rows, open(os.environ.get("OUT", ".") + "/" + os.environ.get("PROBE_NAME", "lpt_probe")
                     + ".json", "w"), indent=1)
