"""The fused SiLU * up + per-token e4m3 kernel (pallas_kernels/swiglu_quant.py) under block
variants, against XLA's unfused route, at the 8B MLP's F on the throughput run's M values.

    python -m bench.swiglu_quant --out swiglu_quant.json [--ms 384,488,2048] [--passes 2]

One process; each variant is timed as bench/fp8_matmul.py times ops (one jitted program over
rotated input buffers so L2 does not hold the next one, median over samples). `TBps` counts
the bytes the fused kernel must move: y read once, h_q and the scales written. With --passes
> 1 the whole list runs again, so run-to-run noise shows beside the differences.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp

from bench.common import new_result, save
from bench.fp8_matmul import add_timing_args, time_per_op
from pallas_kernels import swiglu_quant as sq

T = sq.Tiles
# The two-pass form's other blocks were slower everywhere (history/swiglu_quant_6ef3735.json
# keeps them), and so were the one-pass form with every load issued first and with h
# recomputed from y in registers (history/swiglu_quant_6709054.json), rows 2, 4 warps and
# 1,024-column chunks (history/swiglu_quant_d23b27f.json); rerun them from those commits'
# lists. The list below steps from TILES to TILES_LARGE one change at a time.
VARIANTS = [T(fast_math=True, num_warps=16),                 # TILES until the 22nd session
            T(fast_math=True, num_warps=16, clip=False),     # TILES since
            T(asm=True, num_warps=16, clip=False, flat=True, vec_amax=True),
            T(asm=True, num_warps=16, clip=False, flat=True, vec_amax=True, fold_xs=True),
            T(asm=True, num_warps=16, clip=False, flat=True, vec_amax=True, row_loop=8),
            sq.TILES_LARGE,
            T(asm=True, num_warps=16, clip=False, flat=True, vec_amax=True, row_loop=8,
              fold_xs=True, evict_first=True)]


def xla_route(y, xs, ws):
    """What XLA does without the kernel: SiLU * up, the rows' amax, the cast."""
    return sq.swiglu_quant_reference(y, xs, ws)


def bench_m(m, f, args, rows, pas, variants=None):
    key = jax.random.PRNGKey(m)
    count = min(args.max_rotate, max(2, math.ceil(args.rotate_mb * 2**20 / (m * 2 * f * 2))))
    ys = [jax.random.normal(jax.random.fold_in(key, i), (m, 2 * f), jnp.bfloat16) * 4
          for i in range(count)]
    args_w = [(jnp.full((m, 1), 0.01, jnp.float32), jnp.ones((2 * f,), jnp.float32))] * count
    ref = sq.swiglu_quant_reference(ys[0], *args_w[0])
    moved = m * 2 * f * 2 + m * f + m * 4
    impls = [("xla", None, xla_route)] + [
        ("kernel", t, lambda y, xs, ws, t=t: sq.swiglu_quant(y, xs, ws, tiles=t))
        for t in (variants or VARIANTS)]
    for name, t, fn in impls:
        row = {"impl": name, "M": m, "F": f, "pass": pas}
        if t is not None:
            row.update(tiles=str(t).replace("Tiles", ""),
                       rows_per_program=sq.block_rows(m, f, t))
        try:
            sec, _, out = time_per_op(fn, ys, args_w, args.samples)
        except Exception as e:   # one broken variant must not cost the others
            rows.append({**row, "error": repr(e)[:400]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        q, s = out
        same = float(jnp.mean((q.astype(jnp.float32) == ref[0].astype(jnp.float32))
                              .astype(jnp.float32)))
        rows.append({**row, "us": round(sec * 1e6, 2), "TBps": round(moved / sec / 1e12, 3),
                     "codes_equal_ref": round(same, 5),
                     "scale_rel_err": float(jnp.max(jnp.abs(s / ref[1] - 1)))})
        print(json.dumps(rows[-1]), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p, shapes=False)
    p.add_argument("--ms", default="384,488,2048", help="comma-separated token counts M")
    p.add_argument("--f", type=int, default=14336, help="the MLP's F (Llama-3-8B: 14336)")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--variants", default="",
                   help="';'-separated Tiles as JAXINFER_SWIGLU_TILES takes them (e.g. "
                        "'fast_math=1,num_warps=16;asm=1,num_warps=16'); default: VARIANTS")
    args = p.parse_args(argv)
    variants = [sq.parse_tiles(v) for v in args.variants.split(";")] if args.variants else None
    result = new_result("swiglu_quant", args.git,
                        command=" ".join(["python -m bench.swiglu_quant"] + sys.argv[1:]),
                        default_tiles=str(sq.TILES), default_tiles_large=str(sq.TILES_LARGE),
                        large_m=sq.LARGE_M)
    for pas in range(args.passes):
        for m in (int(v) for v in args.ms.split(",")):
            bench_m(m, args.f, args, result["rows"], pas, variants)
            save(result, args.out)
    for r in result["rows"]:
        print(f'{r["impl"]:>6} M={r["M"]:>5} pass {r["pass"]} {r.get("tiles", ""):<95} '
              + (f'{r["us"]:>8.2f} us {r["TBps"]:>5.2f} TB/s' if "us" in r else r["error"][:60]))


if __name__ == "__main__":
    main()
