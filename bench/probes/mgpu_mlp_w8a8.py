"""The batch-1 FP8 MLP kernel of mgpu_mlp.py with FP8 activations (W8A8): a probe.

No conversion in the kernel: both wgmma operands e4m3 straight from shared memory. Tokens
are wgmma's M side (64 rows, the real ones first) and weights its N side (the K-major B
operand, as 8-bit wgmma wants it), so each program's h comes out token-major and is the A
operand of the down projection as it is, after a per-token scale over the program's slice.
Only the rows of y0 (the real tokens: R = 8 padded rows, or one) are reduce-added.

H200 (bench/results/mgpu_mlp_w8a8.json, history/mgpu_mlp_w8a8_*): 63.7-67.7 us against XLA's
51-53 at the 8B MLP, 62.6 reduce-adding the one real row; rel_err 0.04 against the f32
reference (the activations' e4m3 rounding). Run through `python -m bench.probes.mgpu_mlp
--forms w8a8,w8a8r1`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bench.probes.mgpu_mlp import Config, down_f, down_pipeline
from bench.probes.mgpu_util import launch_into, load_vec, transforms, zeros_wgmma

R = 8      # output rows of the W8A8 form: the padded batch-1 rows (a TMA box of 8 rows)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def fused_mlp_q(xq, xs, w_gu, s_gu, w_d, s_d, y0, *, cfg: Config = Config(),
                interpret: bool = False):
    """The same MLP with FP8 activations (W8A8): no conversion in the kernel, both wgmma
    operands e4m3 straight from shared memory. xq [64, E] e4m3 (x per token over its scale
    xs [64] f32; rows past the real ones zero), w_gu [2F, E], s_gu [2F], w_d [E, F], s_d [E],
    y0 [r, E] f32 (r <= 64: the rows reduce-added, the real tokens) -> y0 + MLP(x)[:r].

    Tokens are wgmma's M side here (64 rows, the real ones first) and weights its N side (the
    K-major B operand, as 8-bit wgmma wants it), so each program's h comes out [64, FS]: h is
    quantized per token over its slice (one scale per token and program, taken back in the
    down projection's epilogue) and is then the A operand of the down projection as it is.
    The down partials [64, tile_e] are reduce-added for their first r rows only."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    m, e = xq.shape
    r = y0.shape[0]          # rows reduce-added: the real tokens (R = 8 padded, or fewer)
    f = down_f(w_d, cfg)
    fs, tk, te = cfg.fs, cfg.tile_k, cfg.tile_e
    if (m != 64 or f % fs or e % tk or e % te or w_gu.shape != (2 * f, e)
            or y0.shape[1] != e or y0.shape[0] > m):
        raise ValueError(f"mgpu_mlp: {cfg} does not tile E={e}, F={f}, M={m}")
    programs, up0 = f // fs, f // fs
    x_tf = w_tf = transforms(plgpu, tk, 8)     # e4m3 tiles with tile_k or FS bytes per row
    d_tf = h_tf = transforms(plgpu, fs, 8)
    # tiled (8-row tiles) for the TMA unless fewer than 8 rows go out: row slices of a
    # tiled buffer must be whole tiles (the H200 refused a 1-row slice)
    o_tf = transforms(plgpu, te, 32) if r % 8 == 0 else ()
    rows, cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def mma(acc, a, b_ref):
        """acc + a @ b_ref^T (b_ref [N, K], K-major)."""
        if interpret:
            return acc + jnp.dot(a[...].astype(jnp.float32), b_ref[...].astype(jnp.float32).T)
        return pl.run_state(lambda r: plgpu.wgmma(r, a, plgpu.transpose_ref(b_ref, (1, 0))))(
            plgpu.ACC.init(acc))

    def zeros(shape):
        return zeros_wgmma(shape, interpret)

    def load(ref, layout):
        return load_vec(ref, layout, interpret)

    def program(x_gmem, xs_gmem, wgu_gmem, sgu_gmem, wd_gmem, sd_gmem, y_gmem,
                h_smem, o_smem, s_smem, xs_smem, bars):
        p = lax.axis_index("p")
        plgpu.copy_gmem_to_smem(sgu_gmem.at[pl.ds(p * fs, fs)], s_smem.at[0], bars.at[0])
        plgpu.copy_gmem_to_smem(sgu_gmem.at[pl.ds(f + p * fs, fs)], s_smem.at[1], bars.at[1])
        plgpu.copy_gmem_to_smem(xs_gmem, xs_smem, bars.at[2])

        def gate_up(_, x_smem, g_smem, u_smem, carry):
            g, u = carry
            return mma(g, x_smem, g_smem), mma(u, x_smem, u_smem)

        g, u = plgpu.emit_pipeline(
            gate_up, grid=(e // tk,), max_concurrent_steps=cfg.stages,
            in_specs=[plgpu.BlockSpec((m, tk), lambda k: (0, k), transforms=x_tf),
                      plgpu.BlockSpec((fs, tk), lambda k: (p, k), transforms=w_tf),
                      plgpu.BlockSpec((fs, tk), lambda k: (up0 + p, k), transforms=w_tf)],
            init_carry=(zeros((m, fs)), zeros((m, fs))))(x_gmem, wgu_gmem, wgu_gmem)
        for i in range(3):
            plgpu.barrier_wait(bars.at[i])
        x_scale = lax.broadcast_in_dim(load(xs_smem, rows), (m, fs), [0])
        g = g * x_scale * lax.broadcast_in_dim(load(s_smem.at[0], cols), (m, fs), [1])
        u = u * x_scale * lax.broadcast_in_dim(load(s_smem.at[1], cols), (m, fs), [1])
        h = g * jax.nn.sigmoid(g) * u
        h_scale = jnp.maximum(jnp.max(jnp.abs(h), axis=1), 1e-30) / 448.0     # [64]
        h_smem[...] = (h / lax.broadcast_in_dim(h_scale, (m, fs), [0])).astype(w_d.dtype)
        plgpu.commit_smem()

        def down(idx, d_smem, sd_smem):
            j = idx[0]
            y = mma(zeros((m, te)), h_smem, d_smem)
            y = (y * lax.broadcast_in_dim(h_scale, (m, te), [0])
                 * lax.broadcast_in_dim(load(sd_smem, cols), (m, te), [1]))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dst = y_gmem.at[:, pl.ds(j * te, te)]
            if interpret:     # no TMA reduction there (programs run one after another)
                o_smem[...] = y
                o_smem[pl.ds(0, r)] = o_smem[pl.ds(0, r)] + y_gmem[:, pl.ds(j * te, te)]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, r)], dst)
                plgpu.wait_smem_to_gmem(0)
                return
            o_smem[...] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, r)], dst, reduction_op="add")

        down_pipeline(plgpu, down, cfg, p, d_tf, e)(wd_gmem, sd_gmem)
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((m, fs), w_d.dtype, transforms=h_tf),
               plgpu.SMEM((m, te), jnp.float32, transforms=o_tf),
               plgpu.SMEM((2, fs), jnp.float32), plgpu.SMEM((m,), jnp.float32),
               plgpu.Barrier(num_barriers=3)]
    return launch_into(program, scratch, programs, (xq, xs, w_gu, s_gu, w_d, s_d), y0, interpret)


def quantize_tokens(x, m: int = 64):
    """x [R, E] -> (xq [m, E] e4m3, per token over its scale, rows past R zero; xs [m] f32)."""
    xf = x.astype(jnp.float32)
    sc = jnp.maximum(jnp.max(jnp.abs(xf), axis=1), 1e-30) / 448.0
    xq = jnp.zeros((m, x.shape[1]), jnp.float8_e4m3fn).at[:x.shape[0]].set(
        (xf / sc[:, None]).astype(jnp.float8_e4m3fn))
    return xq, jnp.zeros((m,), jnp.float32).at[:x.shape[0]].set(sc)
