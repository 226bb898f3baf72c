"""The sweep of the batch-1 Mosaic GPU MLP probe (mgpu_mlp.py and its variants) against
XLA's route: `python -m bench.probes.mgpu_mlp` runs it (mgpu_mlp.main); the rows carry each
form's config, device time and error against the f32 reference."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import emit_row, new_result, save
from bench.probes.mgpu_mlp import (Config, block_down, fused_mlp_t, pad_t, reference,
                                   xla_route)
from bench.probes.mgpu_util import GPU, try_config, with_times


def sweep(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description="The batch-1 FP8 MLP as one Mosaic GPU kernel against XLA's route")
    p.add_argument("--shape", default="4096x14336" if GPU else "256x256", help="E x F")
    p.add_argument("--configs", default="128,128,128,3;128,128,256,3;128,128,128,4;"
                   "64,256,256,3;64,128,256,4" if GPU else "128,128,128,2",
                   help="';'-separated fs,tile_k,tile_e,stages"
                        "[,blocked,down_only,obufs,stagger,plain_store,out_cols,group,"
                        "no_epi]")
    p.add_argument("--rotate", type=int, default=3, help="weight sets rotated per timing")
    p.add_argument("--forms", default="w8a16,w8a8,ws",
                   help="w8a16: fused_mlp_t (f16 activations); w8a8: fused_mlp_q; ws: "
                        "fused_mlp_ws (warp-specialized, f16 activations); w8a8r1: fused_mlp_q "
                        "reduce-adding only the first (real) row")
    p.add_argument("--git", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from bench.fp8_matmul import time_per_op
    from checkpoints.fp8 import quantize_linear

    e, f = (int(v) for v in args.shape.split("x"))
    result = new_result("mgpu_mlp", args.git,
                        command=" ".join(["python -m bench.probes.mgpu_mlp"] + sys.argv[1:]))
    key = jax.random.PRNGKey(0)
    sets = []
    for i in range(args.rotate if GPU else 1):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        sets.append((*quantize_linear(jax.random.normal(k1, (e, 2 * f)) * 0.02),
                     *quantize_linear(jax.random.normal(k2, (f, e)) * 0.02)))
    x = jax.random.normal(key, (8, e), jnp.float32).astype(jnp.bfloat16)
    resid = jax.random.normal(jax.random.fold_in(key, 99), (8, e), jnp.bfloat16)
    ref = np.asarray(reference(x.astype(jnp.float32), *sets[0], resid.astype(jnp.float32)))
    gb = 3 * e * f / 1e9

    sec, dev, y = time_per_op(lambda xr, *w: xla_route(xr[0], xr[1], *w),
                              [(x, resid)] * len(sets), sets, samples=5 if GPU else 1,
                              device=GPU)
    emit_row(result, with_times({"impl": "xla_route", "E": e, "F": f,
                                 "rel_err": float(np.linalg.norm(np.asarray(y, np.float32) - ref)
                                                  / np.linalg.norm(ref))}, sec, dev, gb))

    from bench.probes.mgpu_mlp_w8a8 import fused_mlp_q, quantize_tokens
    from bench.probes.mgpu_mlp_ws import fused_mlp_ws

    def f16_form(kernel):
        def run(xr, w_gu, s_gu, w_d, s_d, cfg):
            xv, rv = xr
            xt, y0 = pad_t(xv, rv)
            out = kernel(xt, w_gu, s_gu, w_d, s_d, y0, cfg=cfg, interpret=not GPU)
            return out.T[:xv.shape[0]].astype(xv.dtype)
        return run

    def ours_q(xr, w_gu, s_gu, w_d, s_d, cfg):
        xv, rv = xr           # x quantized per token here (the model's norm_quant does it)
        out = fused_mlp_q(*quantize_tokens(xv), w_gu, s_gu, w_d, s_d, rv.astype(jnp.float32),
                          cfg=cfg, interpret=not GPU)
        return out.astype(xv.dtype)

    def ours_q1(xr, w_gu, s_gu, w_d, s_d, cfg):
        """Batch 1 proper: only the real row is reduce-added (the other rows of the result
        are the residual's, unchanged)."""
        xv, rv = xr
        y1 = ours_q((xv[:1], rv[:1]), w_gu, s_gu, w_d, s_d, cfg)
        return jnp.concatenate([y1, rv[1:]])

    forms = args.forms.split(",")
    for key, form, fn0 in (("w8a16", "mgpu_mlp", f16_form(fused_mlp_t)),
                           ("w8a8", "mgpu_mlp_w8a8", ours_q),
                           ("ws", "mgpu_mlp_ws", f16_form(fused_mlp_ws)),
                           ("w8a8r1", "mgpu_mlp_w8a8_r1", ours_q1)):
        if key not in forms:
            continue
        for text in args.configs.split(";"):
            cfg = Config.parse(text)

            def measure(row, fn=functools.partial(fn0, cfg=cfg), key=key, cfg=cfg):
                ws = [(a, b, block_down(c, cfg.fs) if cfg.blocked else c, d)
                      for a, b, c, d in sets]
                sec, dev, y = time_per_op(fn, [(x, resid)] * len(ws), ws,
                                          samples=5 if GPU else 1, device=GPU)
                # rows the form computes
                n = 1 if key == "w8a8r1" else min(cfg.out_cols or len(ref), len(ref))
                row["rel_err"] = float(np.linalg.norm(np.asarray(y, np.float32)[:n] - ref[:n])
                                       / np.linalg.norm(ref[:n]))
                with_times(row, sec, dev, gb)

            emit_row(result, try_config({"impl": form, "E": e, "F": f,
                                         **dataclasses.asdict(cfg)}, measure))
    if args.out:
        save(result, args.out)
    return result
