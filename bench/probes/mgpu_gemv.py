"""Can a Mosaic GPU kernel stream FP8 weights faster than XLA at batch 1? A probe.

The batch-1 FP8 decode step spends 2.25 ms of its 2.8 in GEMMs that move 8.0 GB, ~3.6 TB/s
(bench/results/profile_b1_fp8.json), and the Pallas Triton GEMVs this repository tried never
beat XLA's fused-dequant Triton GEMM (pallas_kernels/fp8_matmul.py, gemv.py). Every batch-1
lever left (issue 4's 1.8x, issue 8's 430 tok/s, a persistent decode step) needs weights
streamed near the 4.27 TB/s read ceiling from a kernel we own. Mosaic GPU is Hopper-native:
TMA copies into shared memory, a multi-stage pipeline of them, wgmma.

The kernel: y^T [N, T] = W [N, K] . x^T [K, T], W in e4m3 (the checkpoint's [out, in]
layout, K contiguous: the wgmma A operand, its rows the output channels) and x^T in f16 with
T (8 or 16) token columns, the padded batch-1 rows (wgmma's B operand, N = T). Each program
owns `tile_m` output channels and one of `splits` K ranges; a pipeline of `stages` TMA copies
streams [tile_m, tile_k] weight tiles and [tile_k, T] x tiles into shared memory; each step
converts the weight tile to f16 in registers (cvt.rn.f16x2.e4m3x2) and issues a wgmma with
the register A operand. The output is the f32 partial [splits, N, T], unscaled (the channel
scale and the sum over splits are the caller's; here they are left out of the timing).

    python -m bench.probes.mgpu_gemv [--shapes 4096x6144,...] [--configs "64,128,4,1;..."]
        [--tokens 8] [--git SHA] [--out FILE]

On the CPU the kernel runs in Mosaic GPU's interpret mode (jax 0.10.2 has it), which checks
the indexing and the math against the reference on small shapes; only the H200 times it.

H200, jax 0.11.2 (bench/results/mgpu_gemv.json, mgpu_gemv_long.json; device us, rows
correct to ~1e-6): at 8 token columns the best configs tie XLA's fused-dequant route on each
8B projection (4096x6144 10.54 vs 10.17, 4096x4096 7.74 vs 7.69, 4096x28672 32.28 vs 31.61,
14336x4096 18.45 vs 18.50), and these leave out the channel scale and the split-K sum
XLA's numbers include. Persistent programs (2 per SM) and splits 2-4 beat a plain grid; 16
token columns lose (x tiles twice the bytes). Long streams reach the same rate in both:
4096x155648 (638 MB) 152.8 us = 4.17 TB/s against XLA's 153.9. The boundaries' price: QKV,
O and gate/up as one 4096x38912 matrix take 39.5 us in XLA against 49.5 as three GEMMs.
Leaving 1-2 wgmma groups in flight across steps (`delay`) changed nothing (32.2-32.6 us on
gate/up; history/mgpu_gemv_delay_1075a8e.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from bench.common import emit_row, new_result, save
from bench.probes.mgpu_util import (GPU, grid_kernel, num_sms, transforms, try_config,
                                    with_times)

SHAPES = "4096x6144,4096x4096,4096x28672,14336x4096"     # K x N: the 8B projections


@dataclasses.dataclass(frozen=True)
class Config:
    tile_m: int = 64       # output channels per work item (a multiple of 64: wgmma's M)
    tile_k: int = 128      # K per pipeline step (a multiple of 32 for e4m3 -> f16)
    stages: int = 4        # TMA copies in flight (max_concurrent_steps)
    splits: int = 1        # K ranges (f32 partials [splits, N, T])
    # 0: one program per work item (a grid of N / tile_m x splits). c > 0: persistent, c
    # programs per SM, each streaming its work items (strided over the list) through one
    # pipeline, so only the first TMA copies of a program wait on memory latency.
    per_sm: int = 0
    a_smem: int = 0        # 1: the f16 weight tile goes back to shared memory for the wgmma
                           # (interpret mode takes only that form; 0: the register operand)
    x_kmajor: int = 0      # 1: x tiles [T, tile_k] (K contiguous; B transposed for the wgmma)
    delay: int = 0         # wgmma groups left in flight at the end of a step (their shared
                           # memory released that many steps later: BlockSpec.delay_release)

    @classmethod
    def parse(cls, text: str) -> "Config":
        return cls(*(int(v) for v in text.split(",")))


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def gemv_t(w, x, *, cfg: Config = Config(), interpret: bool = False):
    """w [N, K] e4m3, x [T, K] f16 -> [splits, N, T] f32 (unscaled partial products)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, k = w.shape
    t = x.shape[0]
    if n % cfg.tile_m or k % (cfg.splits * cfg.tile_k):
        raise ValueError(f"mgpu_gemv: {cfg} does not tile w [{n}, {k}]")
    k_iters = k // cfg.splits // cfg.tile_k
    items = n // cfg.tile_m * cfg.splits
    programs = min(items, num_sms() * cfg.per_sm) if cfg.per_sm else items
    w_tf = transforms(plgpu, cfg.tile_k, 8)
    if cfg.x_kmajor:
        x_block, x_tf = (t, cfg.tile_k), transforms(plgpu, cfg.tile_k, 16)
    else:
        x, x_block, x_tf = x.T, (cfg.tile_k, t), transforms(plgpu, t, 16)
    a_smem = cfg.a_smem or interpret
    scratch = [plgpu.SMEM((cfg.tile_m, t), jnp.float32)]
    if a_smem:
        scratch.append(plgpu.SMEM((cfg.tile_m, cfg.tile_k), jnp.float16,
                                  transforms=transforms(plgpu, cfg.tile_k, 16)))

    def body(w_gmem, x_gmem, o_gmem, o_smem, *a_ref):
        pid = lax.axis_index("p")
        mine = (items - pid + programs - 1) // programs     # work items pid, pid + P, ...

        def item_of(g):                # pipeline step -> (m tile, split, k step)
            item = pid + (g // k_iters) * programs
            return item // cfg.splits, item % cfg.splits, g % k_iters

        def w_index(g):
            m, sp, kk = item_of(g)
            return m, sp * k_iters + kk

        def x_index(g):
            _, sp, kk = item_of(g)
            return (0, sp * k_iters + kk) if cfg.x_kmajor else (sp * k_iters + kk, 0)

        def store(m, sp, value):
            plgpu.wait_smem_to_gmem(0)
            o_smem[...] = value
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[sp, pl.ds(m * cfg.tile_m, cfg.tile_m)])

        def operands(w_smem, x_smem):
            a = w_smem[...].astype(jnp.float16)
            if a_smem:
                a_ref[0][...] = a
                plgpu.commit_smem()
                a = a_ref[0]
            if not cfg.x_kmajor:
                return a, x_smem
            # (interpret mode cannot read a transposed ref: it transposes the value)
            return a, x_smem[...].T if interpret else plgpu.transpose_ref(x_smem, (1, 0))

        pipeline = functools.partial(
            plgpu.emit_pipeline, grid=(mine * k_iters,),
            in_specs=[plgpu.BlockSpec((cfg.tile_m, cfg.tile_k), w_index, transforms=w_tf,
                                      delay_release=cfg.delay),
                      plgpu.BlockSpec(x_block, x_index, transforms=x_tf,
                                      delay_release=cfg.delay)],
            max_concurrent_steps=cfg.stages)

        if interpret:
            # Mosaic GPU's interpret mode (jax 0.10) takes neither an accumulator store nor a
            # register wgmma operand: the same pipeline and indexing with a plain dot (the
            # H200 run checks the wgmma form against the reference).
            def step_i(idx, w_smem, x_smem, acc):
                m, sp, kk = item_of(idx[0])
                a, b = operands(w_smem, x_smem)
                acc = jnp.where(kk == 0, 0.0, acc) + jnp.dot(
                    a[...].astype(jnp.float32), b[...].astype(jnp.float32))

                @pl.when(kk == k_iters - 1)
                def _():
                    store(m, sp, acc)
                return acc

            pipeline(step_i, init_carry=jnp.zeros((cfg.tile_m, t), jnp.float32))(w_gmem, x_gmem)
        else:
            def acc_scope(acc_ref):
                def step(idx, w_smem, x_smem):
                    m, sp, kk = item_of(idx[0])

                    @pl.when(kk == 0)
                    def _():
                        acc_ref[...] = jnp.zeros((cfg.tile_m, t), jnp.float32)

                    plgpu.wgmma(acc_ref, *operands(w_smem, x_smem))
                    plgpu.wgmma_wait(cfg.delay)

                    @pl.when(kk == k_iters - 1)
                    def _():
                        store(m, sp, acc_ref[...])

                pipeline(step)(w_gmem, x_gmem)

            pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, t), jnp.float32))
        plgpu.wait_smem_to_gmem(0)

    return grid_kernel(body, jax.ShapeDtypeStruct((cfg.splits, n, t), jnp.float32), programs,
                       scratch, interpret)(w, x)


def reference(w, x):
    """The same product in f32: [N, T]."""
    return jnp.dot(w.astype(jnp.float32), x.astype(jnp.float32).T)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES if GPU else "256x128",
                   help="comma-separated KxN weight shapes")
    p.add_argument("--configs", default="64,128,4,1;64,256,4,1;128,128,4,1;64,128,6,2",
                   help="';'-separated tile_m,tile_k,stages,splits[,per_sm,a_smem,x_kmajor,delay]")
    p.add_argument("--tokens", type=int, default=16,
                   help="T: padded token columns (16: the f16 x tile's rows need >= 32 bytes "
                        "for a swizzle; XLA's route is timed at its own 8 rows)")
    p.add_argument("--rotate", type=int, default=4, help="weights rotated per timing")
    p.add_argument("--git", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from bench.fp8_matmul import time_per_op
    from checkpoints.fp8 import quantize_linear
    # the model's batch-1 route (fp8_linear at M <= 64, x padded to 8 rows): XLA's GEMM
    # with the e4m3 -> bf16 convert fused, then the channel scale
    from pallas_kernels.fp8_matmul import xla_dequant_matmul

    result = new_result("mgpu_gemv", args.git,
                        command=" ".join(["python -m bench.probes.mgpu_gemv"] + sys.argv[1:]))
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        key = jax.random.PRNGKey(k + n)
        ws = [quantize_linear(jax.random.normal(jax.random.fold_in(key, i), (k, n)) * 0.02)
              for i in range(args.rotate if GPU else 1)]
        x = jax.random.normal(key, (args.tokens, k), jnp.float32).astype(jnp.bfloat16)
        xs = [x] * len(ws)
        gb = n * k / 1e9
        sec, dev, _ = time_per_op(xla_dequant_matmul, [x[:8]] * len(ws), ws,
                                  samples=5 if GPU else 1, device=GPU)
        emit_row(result, with_times({"impl": "xla_dequant", "K": k, "N": n, "T": 8}, sec, dev,
                                    gb))
        ref = np.asarray(reference(ws[0][0], x.astype(jnp.float16)))
        for text in args.configs.split(";"):
            cfg = Config.parse(text)
            fn = functools.partial(gemv_t, cfg=cfg, interpret=not GPU)

            def measure(row):
                out = jax.block_until_ready(fn(ws[0][0], x.astype(jnp.float16)))
                got = np.asarray(out).sum(0)
                row["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                if GPU:
                    sec, dev, _ = time_per_op(lambda x, w, s: fn(w, x.astype(jnp.float16)),
                                              xs, ws, samples=5, device=True)
                    with_times(row, sec, dev, gb)

            emit_row(result, try_config({"impl": "mgpu", "K": k, "N": n, "T": args.tokens,
                                         **dataclasses.asdict(cfg)}, measure))
    if args.out:
        save(result, args.out)
    return result


if __name__ == "__main__":
    main()
