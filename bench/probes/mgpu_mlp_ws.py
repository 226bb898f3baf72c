"""The batch-1 FP8 MLP kernel of mgpu_mlp.py (f16 activations) warp-specialized: a probe.

Per program a memory warpgroup issues every TMA copy of both phases while two compute
warpgroups take half of the F-slice's gate/up rows each (conversion and wgmma), form h for
their rows, meet at a barrier, and take half of each down tile's rows each.

H200 (bench/results/mgpu_mlp_ws.json): 62.0 us at best against XLA's 51.7 at the 8B MLP (the
one-warpgroup form: 63.0-63.6), 67 with FS 256 (56 programs); correct (rel_err 0.0017). Run
through `python -m bench.probes.mgpu_mlp --forms ws`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bench.probes.mgpu_mlp import Config, down_order, down_spec, t_geometry
from bench.probes.mgpu_util import f16, launch_into, load_vec, zeros_wgmma

WS_WGS = 2    # compute warpgroups of the warp-specialized form (a third one issues the TMAs)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def fused_mlp_ws(xt, w_gu, s_gu, w_d, s_d, y0, *, cfg: Config = Config(),
                 interpret: bool = False):
    """fused_mlp_t's math (same arguments) with warp specialization: per program a memory
    warpgroup streams the TMA copies of both phases while two compute warpgroups take half
    of the F-slice's gate/up rows each (conversion and wgmma), form h for their rows, meet
    at a barrier, and take half of each down tile's rows each."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    e, t, f, programs, w_tf, d_tf, x_tf, o_tf = t_geometry(xt, w_gu, w_d, cfg, WS_WGS)
    fs, tk, te = cfg.fs, cfg.tile_k, cfg.tile_e
    hf, he = fs // WS_WGS, te // WS_WGS
    up0 = programs
    row = plgpu.Layout.WGMMA.reduce(1)
    conv = f16

    def zeros(shape):
        return zeros_wgmma(shape, interpret)

    def load_row(ref):
        return load_vec(ref, row, interpret)

    def program(x_gmem, wgu_gmem, sgu_gmem, wd_gmem, sd_gmem, y_gmem,
                h_smem, o_smem, s_smem, bars, h_bar):
        p, wg = lax.axis_index("p"), lax.axis_index("wg")
        rows = pl.ds(wg * hf, hf)          # this compute warpgroup's gate/up rows

        def ctx1(eval_pipeline):
            for i, base in enumerate((0, f)):
                plgpu.copy_gmem_to_smem(sgu_gmem.at[pl.ds(base + p * fs + wg * hf, hf)],
                                        s_smem.at[wg, i], bars.at[2 * wg + i])
            if interpret:
                g, u = eval_pipeline((zeros((hf, t)), zeros((hf, t))))
            else:
                def accs(g_acc, u_acc):
                    g_acc[...] = zeros((hf, t))
                    u_acc[...] = zeros((hf, t))
                    eval_pipeline((g_acc, u_acc))
                    return g_acc[...], u_acc[...]
                g, u = pl.run_scoped(accs, plgpu.ACC((hf, t), jnp.float32),
                                     plgpu.ACC((hf, t), jnp.float32))
            plgpu.barrier_wait(bars.at[2 * wg])
            plgpu.barrier_wait(bars.at[2 * wg + 1])
            g = g * lax.broadcast_in_dim(load_row(s_smem.at[wg, 0]), (hf, t), [0])
            u = u * lax.broadcast_in_dim(load_row(s_smem.at[wg, 1]), (hf, t), [0])
            h_smem[rows] = (g * jax.nn.sigmoid(g) * u).astype(jnp.float16)
            plgpu.commit_smem()
            plgpu.barrier_arrive(h_bar)        # both halves of h written before phase 2
            plgpu.barrier_wait(h_bar)

        def gate_up(_, g_smem, u_smem, x_smem, carry):
            g, u = carry
            if interpret:
                xv = x_smem[...].astype(jnp.float32)
                return (g + jnp.dot(g_smem[rows].astype(jnp.float32), xv),
                        u + jnp.dot(u_smem[rows].astype(jnp.float32), xv))
            plgpu.wgmma(g, conv(g_smem.at[rows]), x_smem)
            plgpu.wgmma(u, conv(u_smem.at[rows]), x_smem)
            plgpu.wgmma_wait(0)
            return carry

        order = down_order(cfg, p, e)

        def down(idx, d_smem, sd_smem):
            j = order(idx[0])
            drows = pl.ds(wg * he, he)
            if interpret:
                y = jnp.dot(d_smem[drows].astype(jnp.float32), h_smem[...].astype(jnp.float32))
            else:
                y = pl.run_state(lambda r: plgpu.wgmma(r, conv(d_smem.at[drows]), h_smem))(
                    plgpu.ACC.init(zeros((he, t))))
            y = y * lax.broadcast_in_dim(load_row(sd_smem.at[drows]), (he, t), [0])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dst = y_gmem.at[pl.ds(j * te + wg * he, he)]
            if interpret:     # no TMA reduction there (programs run one after another)
                o_smem[wg] = y + y_gmem[pl.ds(j * te + wg * he, he)]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], dst)
                plgpu.wait_smem_to_gmem(0)
                return
            o_smem[wg] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], dst, reduction_op="add")

        plgpu.emit_pipeline_warp_specialized(
            gate_up, grid=(e // tk,), memory_registers=40, wg_axis="wg",
            num_compute_wgs=WS_WGS, max_concurrent_steps=cfg.stages, compute_context=ctx1,
            in_specs=[plgpu.BlockSpec((fs, tk), lambda k: (p, k), transforms=w_tf),
                      plgpu.BlockSpec((fs, tk), lambda k: (up0 + p, k), transforms=w_tf),
                      plgpu.BlockSpec((tk, t), lambda k: (k, 0), transforms=x_tf)],
        )(wgu_gmem, wgu_gmem, x_gmem)
        plgpu.emit_pipeline_warp_specialized(
            down, grid=(e // te,), memory_registers=40, wg_axis="wg",
            num_compute_wgs=WS_WGS, max_concurrent_steps=cfg.stages,
            in_specs=[down_spec(plgpu, cfg, p, d_tf, order),
                      plgpu.BlockSpec((te,), lambda j: (order(j),))],
        )(wd_gmem, sd_gmem)

        @pl.when(wg < WS_WGS)
        def _():
            plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((fs, t), jnp.float16, transforms=x_tf),
               plgpu.SMEM((WS_WGS, he, t), jnp.float32, transforms=o_tf),
               plgpu.SMEM((WS_WGS, 2, hf), jnp.float32),
               plgpu.Barrier(num_barriers=2 * WS_WGS),
               plgpu.Barrier(num_arrivals=WS_WGS)]
    return launch_into(program, scratch, programs, (xt, w_gu, s_gu, w_d, s_d), y0, interpret,
                   threads=WS_WGS + 1)
