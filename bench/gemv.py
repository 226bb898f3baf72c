"""The batch-1 bf16 GEMV (pallas_kernels/gemv.py) against XLA on the same fused ops.

    python -m bench.gemv --out /tmp/gemv.json          # H200: ~2 minutes

On each Llama-3-8B projection (K x N), with the neighbours the decoder layer would fuse into
it (GEMV_FUSION: RMSNorm or SiLU * up before, the residual add after): `xla_model_ops` is
gemv_reference (the model's own ops, fused as XLA fuses them), each `gemv_*` row one tiling of
GEMV_TILES. Timing as bench/fp8_matmul.py's (one process, weights rotated past the L2,
back-to-back calls); `TBps` counts the bf16 weight bytes; each row carries its max abs error
against gemv_reference and its compiled kernels. The tenth session ran this as
`bench.fp8_matmul --gemv` (bench/results/history/gemv_b1_f8cae9d.json).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import jax
import jax.numpy as jnp

from bench.common import new_result, save
from bench.fp8_matmul import add_timing_args, hlo_kernels, time_per_op
from pallas_kernels import gemv as gv

GEMV_FUSION = {(4096, 6144): ("rmsnorm", False), (4096, 4096): ("none", True),
               (4096, 28672): ("rmsnorm", False), (14336, 4096): ("swiglu", True)}
GEMV_TILES = [dict(), dict(bn=32), dict(bn=128), dict(bk=128), dict(bk=512),
              dict(splits=1), dict(splits=2), dict(num_warps=8), dict(num_stages=4),
              dict(reduce_each_step=False, bk=64)]


def bench_gemv(args, rows, on_shape=lambda: None):
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        prologue, residual = GEMV_FUSION.get((k, n), ("none", False))
        key = jax.random.PRNGKey(k + n)
        count = min(args.max_rotate, max(2, math.ceil(args.rotate_mb * 2**20 / (2 * k * n))))
        width = 2 * k if prologue == "swiglu" else k
        xs = [jax.random.normal(jax.random.fold_in(key, i), (1, width), jnp.bfloat16)
              for i in range(count)]
        weights = [((jax.random.normal(jax.random.fold_in(key, 100 + i), (k, n)) * 0.02
                     ).astype(jnp.bfloat16),
                    jnp.ones((k,), jnp.bfloat16) if prologue == "rmsnorm" else None,
                    jax.random.normal(jax.random.fold_in(key, 200 + i), (1, n), jnp.bfloat16)
                    if residual else None) for i in range(count)]
        kw = dict(prologue=prologue)
        interpret = jax.default_backend() != "gpu"
        ref = gv.gemv_reference(xs[0], weights[0][0], norm_weight=weights[0][1],
                                residual=weights[0][2], **kw)
        impls = {"xla_model_ops": lambda x, w, nw, r: gv.gemv_reference(
            x, w, norm_weight=nw, residual=r, **kw)}
        for v in GEMV_TILES:
            t = gv.tiles_for(k, n, **v)
            impls[f"gemv_bn{t.bn}_bk{t.bk}_s{t.splits}_w{t.num_warps}_st{t.num_stages}"
                  f"{'' if t.reduce_each_step else '_acc'}"] = functools.partial(
                lambda x, w, nw, r, t: gv.gemv(x, w, norm_weight=nw, residual=r, tiles=t,
                                               interpret=interpret, **kw), t=t)
        for name, fn in impls.items():
            row = {"impl": name, "M": 1, "K": k, "N": n, "prologue": prologue,
                   "residual": residual}
            try:
                sec, _, y = time_per_op(fn, xs, weights, args.samples)
                row.update(us=round(sec * 1e6, 2), TBps=round(2 * k * n / sec / 1e12, 3),
                           max_abs_err=float(jnp.max(jnp.abs(y.astype(jnp.float32)
                                                             - ref.astype(jnp.float32)))),
                           hlo=hlo_kernels(fn, xs[0], weights[0]))
            except Exception as e:   # one broken tiling must not cost the other rows
                row["error"] = repr(e)[:400]
            rows.append(row)
            print(json.dumps(row), flush=True)
        on_shape()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p)
    args = p.parse_args(argv)
    result = new_result("gemv", args.git,
                        command=" ".join(["python -m bench.gemv"] + sys.argv[1:]))
    bench_gemv(args, result["rows"], lambda: save(result, args.out))
    for r in result["rows"]:
        print(f'{r["impl"]:>34} {r["K"]:>5}x{r["N"]:<5} ' + (
            f'{r["us"]:>8.1f} us {r["TBps"]:>6.2f} TB/s err {r["max_abs_err"]:.1e} '
            f'{r["hlo"]["by_kind"]}' if "us" in r else r["error"][:90]))
    return result


if __name__ == "__main__":
    main()
