"""Does XLA run independent kernels of one program at the same time? A probe for an
overlap of memory-bound attention with compute-bound GEMMs (two halves of a batch, one's
attention beside the other's MLP), which needs it.

    XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT \\
        python -m bench.probes.concurrent [--out FILE]

One process times three jitted programs by the host clock over back-to-back calls (median
of repeats): A = FP8 paged decode attention (B=256, S=1536, the tuned kernel) four times
over four caches, B = an FP8 GEMM (M=2048, 4096 x 28672) four times, and A+B = both in one
program with no data between them. If the runtime serializes them, A+B takes A + B; if it
overlaps them, less. Run once per scheduling mode (the flag is read at start-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from bench.kernels import impls, make_case, tuned_blocks
from bench.probes import write_probe
from pallas_kernels import fp8_matmul as fm


def _time(fn, args, calls: int = 20, repeats: int = 5) -> float:
    """Seconds per call of fn(*args), `calls` dispatched back to back and one block (not
    bench.common.timed, which blocks on every call: A and B timed apart would then count one
    host round trip more than A+B)."""
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--git", default=None, help="git sha to record (default: git rev-parse "
                   "HEAD; the GPU machine's copy of the tree may carry an older .git)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--m", type=int, default=2048, help="the GEMM's rows")
    p.add_argument("--n", type=int, default=28672, help="the GEMM's output width")
    args = p.parse_args(argv)
    batch, context = args.batch, args.context
    attn = impls(True, tuned_blocks(batch, context, True), tuned=True)["jaxinfer"]
    cases = [make_case(batch, context, True, jax.random.PRNGKey(i)) for i in range(4)]
    key = jax.random.PRNGKey(9)
    x = jax.random.normal(key, (args.m, 4096), jnp.bfloat16).astype(fm.FP8_DTYPE)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (args.n, 4096), jnp.bfloat16)
          .astype(fm.FP8_DTYPE) for i in range(4)]

    def a_part(cs):
        return [attn(q, k, v, ks, vs, t[0], lens) for q, k, v, (ks, vs), t, lens in cs]

    def b_part(x, ws):
        return [fm.tc_product(x, w, jnp.bfloat16) for w in ws]

    fa = jax.jit(a_part)
    fb = jax.jit(b_part)
    fab = jax.jit(lambda cs, x, ws: (a_part(cs), b_part(x, ws)))
    ta, tb, tab = _time(fa, (cases,)), _time(fb, (x, ws)), _time(fab, (cases, x, ws))
    row = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "a_us": round(ta * 1e6, 1),
           "b_us": round(tb * 1e6, 1), "a_plus_b_us": round(tab * 1e6, 1),
           "overlap_us": round((ta + tb - tab) * 1e6, 1)}
    print(json.dumps(row), flush=True)
    if args.out:
        write_probe(args.out, "concurrent", args.git, argv, [row])


if __name__ == "__main__":
    main()
