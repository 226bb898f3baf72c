"""The batch-1 FP8 MLP as one Mosaic GPU kernel, no grid-wide barrier: a probe.

At batch 1 the decoder layer's MLP is four XLA kernels today (the gate/up GEMM, SiLU * up,
the down GEMM split over K, the split's reduction with the residual add): ~52 us per layer
on the H200 (bench/results/profile_b1_fp8.json), where its 176 MB of e4m3 weights take 41 us
at 4.27 TB/s. bench/probes/mgpu_gemv.py measured the kernel boundaries' share: QKV, O and
gate/up streamed as one [38912, 4096] matrix take 39.5 us against 49.5 us as three GEMMs.

Here the MLP's dependency is cut by rows of F instead of a barrier: program p owns F-slice
p (FS channels). It streams its FS gate rows and FS up rows of w_gu ([2F, E], e4m3) through a
TMA pipeline into two wgmma accumulators [FS, T] over x^T ([E, T] f16, T = 16 padded token
columns), applies the channel scales and forms h = SiLU(gate) * up for its slice in
registers, puts h (f16) in shared memory, then streams its column slice of w_d ([E, F],
e4m3: tiles [tile_e, FS]) in a second pipeline, each tile a wgmma with h as the B operand,
scaled by the down projection's channel scales and reduce-added (TMA `cp.reduce.async.bulk`
add, f32) into y [E, T], which comes in holding the residual (aliased): y = residual + MLP(x).
No kernel of its own for SiLU * up, the split-K sum or the residual add.

    python -m bench.probes.mgpu_mlp [--forms w8a16,w8a8,ws,w8a8r1]
        [--configs "fs,tile_k,tile_e,stages[,blocked,down_only,obufs,stagger,plain_store,
                    out_cols,group,no_epi];..."] [--git SHA] [--out FILE]

On the CPU it runs in Mosaic GPU's interpret mode at a small shape (the wgmma register
operand is replaced there by a plain dot, mgpu_util.py says why, and the TMA reduction by a
read, add and write); the H200 checks the real form against the reference and times it
against XLA's route.

Two variants of the kernel live beside it, timed by the sweep (`--forms`; the sweep itself is
in mgpu_mlp_sweep.py, run through this module's main):
mgpu_mlp_w8a8.py (FP8 activations, no conversion) and mgpu_mlp_ws.py (warp-specialized).
The Mosaic GPU plumbing they share (the in-place launch, interpret-mode stand-ins) is in
mgpu_util.py.

H200, jax 0.11.2 (bench/results/mgpu_mlp.json, mgpu_mlp_w8a8.json, mgpu_mlp_ws.json,
ncu_mgpu_mlp.txt; more sweeps in history/mgpu_mlp_*): correct (rel_err 0.0017 against the
f32 reference; XLA's route 0.0047; the W8A8 forms 0.04, their activations' e4m3 rounding)
but slower than XLA's 51-53 us in every form tried, all within 62-68 us at their best (FS
128, 112 programs): f16 activations 63.0-63.6, W8A8 63.7-67.7, W8A8 reduce-adding only the
real row (1.8 MB of reductions instead of 14.7 with 8 rows) 62.6, w_d blocked per F-slice
63.3, warp-specialized (a TMA warpgroup, two compute warpgroups) 62.0; FS 64 (224 programs)
76-94, FS 256 (56 programs, warp-specialized) 67, more stages or other tiles 63-80. Ruled
out as the limit, then: the e4m3 conversions, the reduce-add traffic, the down weights' DRAM
layout and one warpgroup doing all the work. Nsight Compute (f16 form): DRAM 62%, L2 81%,
one 128-thread program per SM; of the stall samples
(history/ncu_mgpu_mlp_sass_8225f1a.csv.gz) ~16% wait for TMA data (the mbarrier try-wait),
~16% for wgmma completion, ~31% on shared loads and converts. Nor is the SM count: at F =
16,896 (132 programs, one per SM; history/mgpu_mlp_f16896_8ce4ca1.json) the f16 and
warp-specialized forms took 69.5-71.4 us against XLA's 62.5, so the kernel's aggregate rate
stays at 2.6-3.0 TB/s with 56, 112 or 132 programs, where XLA's route reads the same weights
at 3.3-3.4 TB/s and the standalone GEMV at 3.6. Nsight Compute side by side with the GEMV
(history/ncu_mem_mgpu_{gemv,mlp}_31c9189.txt): GEMV DRAM 78%, L2 79% busy, 8% L2 hits; this
kernel DRAM 62%, L2 80%, 18.5% hits.

Taken apart (twenty-fourth session; bench/results/mgpu_mlp_outcols.json, history/mgpu_mlp_
{obufs,rotate,down,store,outcols}_*.json, history/ncu_mgpu_mlp_*_efd1b5d.txt), FS 128, tile_e
256, 3 stages: the gate/up phase is fine and the down phase is the loss. The down phase
alone (`down_only`, h = 0) takes 29.6-34.4 us for its 58.7 MB (~2 TB/s), where XLA's down
GEMM and its reduction take 18.7; the whole kernel minus it, ~30 us for 117 MB of gate/up
weights (~3.9 TB/s, by the difference, not timed alone), is no slower than the standalone
GEMV on that shape (3.6 TB/s in the same call). In the down phase: every program
walking the tiles of y in step (all 112 reduce-adding the same rows at once) cost ~4 us
(`stagger`: down alone 33.9 -> 29.9, whole 63.6 -> 59.9); the reductions themselves ~2.5 us
(`plain_store`, wrong results by design: 29.9 -> 27.4); reduce-adding 4 token columns of 16
(`out_cols`, the rest padding at batch 1) ~3 us (whole 58.8 -> 55.7, correct); output slots
in flight (`obufs`), stages 3-6 and tiles of 64-256 rows nothing (smaller tiles slower).
Nsight Compute, down phase alone with plain stores: 24.5 us, DRAM 52%, L2 76% busy with 36%
hits, one 128-thread program per SM (187 registers), no eligible warp 78% of cycles; the
whole kernel (staggered): DRAM 66%, L2 84%, 20% hits. So the 16-column f32 partials were
part of the L2 load (the hypothesis of the twenty-third session, in that form), but with
them cut to 4 columns the down phase still streams at ~2.2 TB/s: best 55.7 us against
XLA's 51.6 in the same call. With no per-step epilogue at all (`no_epi`: every down tile
accumulated into one accumulator and stored once, wrong results by design) the down phase
alone still takes 23.0-23.3 us (blocked weights or not, 128- or 256-row tiles) and the whole
kernel 52.9 against XLA's 52.6 (history/mgpu_mlp_{group,blocked}_5b67a47.json): the
epilogue costs ~3.5 us, the rest is the down loop's streaming itself, ~22 GB/s per SM
against ~33 in the gate/up phase with as many bytes in flight. Storing 4 tiles per TMA
(`group`) was slower (61.4 against 58.8; with `out_cols` refused: a TMA box takes <= 256
rows). Nor is it one TMA stream per step against the gate/up phase's two: each down tile
loaded as two halves (`no_epi` 2) took 22.5 us against 23.0 (history/mgpu_mlp_streams_
7bc3872.json). Not explained; even a free epilogue would only tie XLA.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bench.probes.mgpu_util import f16, launch_into, load_vec, transforms, zeros_wgmma

T = 16     # padded token columns (x^T's tiles need rows of >= 32 bytes for a swizzle)


@dataclasses.dataclass(frozen=True)
class Config:
    fs: int = 128          # F channels per program (a multiple of 64)
    tile_k: int = 256      # E per step of the gate/up pipeline
    tile_e: int = 256      # down-projection output rows per step (a multiple of 64)
    stages: int = 3        # TMA copies in flight per pipeline
    # 1: w_d comes blocked, [F / FS, E, FS] (block_down), so a program's down weights are
    # one contiguous run instead of E rows of FS bytes 14 KB apart
    blocked: int = 0
    # 1: fused_mlp_t runs its down phase alone, over h = 0 (a timing split; y comes back
    # as the residual). The gate/up phase alone cannot be timed so: with nothing leaving
    # the kernel, the H200 ran it in 0.9 us (7a25e6a)
    down_only: int = 0
    obufs: int = 1         # fused_mlp_t's output tiles in flight (o_smem slots)
    # 1: program p walks its down tiles from tile p (mod E / tile_e) instead of 0, so the
    # programs' reduce-adds land on different rows of y at a time (down_order)
    stagger: int = 0
    # 1: fused_mlp_t stores its down partials instead of reduce-adding them (a timing
    # split: wrong results; the reduction's price)
    plain_store: int = 0
    # c > 0: fused_mlp_t reduce-adds only the first c token columns of y (from an untiled
    # output buffer; TMA boxes need >= 16 bytes, so c >= 4): at batch 1 the rest are
    # padding, and the 16-column partials are half of the down phase's L2 traffic
    out_cols: int = 0
    # g > 1: fused_mlp_t stores its down partials every g steps (g tiles of y, one TMA):
    # the fence, the wait on the last store and the TMA issue paid once per g tiles
    group: int = 1
    # 1: fused_mlp_t's down steps only accumulate (all tiles into one accumulator, stored
    # once at the end: wrong results, the GPU only): a timing split without any per-step
    # epilogue (scale, shared-memory store, fence, TMA). 2: the same with each step's tile
    # loaded as two [tile_e / 2, FS] halves (two TMA streams, as the gate/up phase has)
    no_epi: int = 0

    @classmethod
    def parse(cls, text: str) -> "Config":
        return cls(*(int(v) for v in text.split(",")))


def t_geometry(xt, w_gu, w_d, cfg: Config, wgs: int = 1):
    """Shapes and shared-memory transforms of the f16-activation forms (fused_mlp_t with
    wgs = 1, fused_mlp_ws with its compute warpgroups): (e, t, f, programs, w_tf, d_tf,
    x_tf, o_tf); rejects what does not tile."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    e, t = xt.shape
    f = down_f(w_d, cfg)
    fs, tk, te = cfg.fs, cfg.tile_k, cfg.tile_e
    if (f % fs or e % tk or e % (te * cfg.group) or (fs // wgs) % 64 or (te // wgs) % 64
            or w_gu.shape != (2 * f, e) or t != T):
        raise ValueError(f"mgpu_mlp: {cfg} does not tile E={e}, F={f}, T={t} with {wgs} "
                         "compute warpgroups")
    return (e, t, f, f // fs, transforms(plgpu, tk, 8), transforms(plgpu, fs, 8),
            transforms(plgpu, t, 16), transforms(plgpu, t, 32))


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def fused_mlp_t(xt, w_gu, s_gu, w_d, s_d, y0, *, cfg: Config = Config(),
                interpret: bool = False):
    """xt [E, T] f16, w_gu [2F, E] e4m3 (gate rows, then up rows), s_gu [2F] f32, w_d [E, F]
    e4m3, s_d [E] f32, y0 [E, T] f32 -> y0 + (w_d' (SiLU(gate) * up))^T [E, T] f32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    e, t, f, programs, w_tf, d_tf, x_tf, o_tf = t_geometry(xt, w_gu, w_d, cfg)
    fs, tk, te = cfg.fs, cfg.tile_k, cfg.tile_e
    up0 = programs            # the up rows start at block F / FS of w_gu
    row = plgpu.Layout.WGMMA.reduce(1)
    conv = f16

    def mma(acc, a, b):
        """acc + a @ b: wgmma on the GPU; a plain dot in interpret mode."""
        if interpret:
            return acc + jnp.dot(a.astype(jnp.float32), b[...].astype(jnp.float32))
        return pl.run_state(lambda r: plgpu.wgmma(r, a, b))(plgpu.ACC.init(acc))

    def zeros(shape):
        return zeros_wgmma(shape, interpret)

    def load_row(ref):
        return load_vec(ref, row, interpret)

    def program(x_gmem, wgu_gmem, sgu_gmem, wd_gmem, sd_gmem, y_gmem,
                h_smem, o_smem, s_smem, bars, *oc_ref):
        p = lax.axis_index("p")
        plgpu.copy_gmem_to_smem(sgu_gmem.at[pl.ds(p * fs, fs)], s_smem.at[0], bars.at[0])
        plgpu.copy_gmem_to_smem(sgu_gmem.at[pl.ds(f + p * fs, fs)], s_smem.at[1], bars.at[1])

        pipeline = functools.partial(
            plgpu.emit_pipeline, grid=(e // tk,), max_concurrent_steps=cfg.stages,
            in_specs=[plgpu.BlockSpec((fs, tk), lambda k: (p, k), transforms=w_tf),
                      plgpu.BlockSpec((fs, tk), lambda k: (up0 + p, k), transforms=w_tf),
                      plgpu.BlockSpec((tk, t), lambda k: (k, 0), transforms=x_tf)])
        if cfg.down_only:
            g = u = zeros((fs, t))
        elif interpret:
            def gate_up(_, g_smem, u_smem, x_smem, carry):
                g, u = carry
                return mma(g, conv(g_smem), x_smem), mma(u, conv(u_smem), x_smem)

            g, u = pipeline(gate_up, init_carry=(zeros((fs, t)), zeros((fs, t))))(
                wgu_gmem, wgu_gmem, x_gmem)
        else:
            def accs(g_acc, u_acc):
                def gate_up(_, g_smem, u_smem, x_smem):
                    plgpu.wgmma(g_acc, conv(g_smem), x_smem)
                    plgpu.wgmma(u_acc, conv(u_smem), x_smem)
                    # waiting here, every step: leaving this step's two wgmmas in flight
                    # (wgmma_wait(2), the tiles released a step later) gave no gain and,
                    # at 4 stages, wrong results (rel_err 0.027; H200, 1075a8e)
                    plgpu.wgmma_wait(0)

                g_acc[...] = zeros((fs, t))
                u_acc[...] = zeros((fs, t))
                pipeline(gate_up)(wgu_gmem, wgu_gmem, x_gmem)
                return g_acc[...], u_acc[...]

            g, u = pl.run_scoped(accs, plgpu.ACC((fs, t), jnp.float32),
                                 plgpu.ACC((fs, t), jnp.float32))
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])
        g = g * lax.broadcast_in_dim(load_row(s_smem.at[0]), (fs, t), [0])
        u = u * lax.broadcast_in_dim(load_row(s_smem.at[1]), (fs, t), [0])
        h_smem[...] = (g * jax.nn.sigmoid(g) * u).astype(jnp.float16)
        plgpu.commit_smem()

        gr = cfg.group
        cols = pl.ds(0, cfg.out_cols or t)

        def down(idx, d_smem, sd_smem):
            j = idx[0]                   # the tile; tiles j // gr * gr ... go out together
            i, slot = j % gr, j // gr % cfg.obufs
            y = mma(zeros((te, t)), conv(d_smem), h_smem)
            y = y * lax.broadcast_in_dim(load_row(sd_smem), (te, t), [0])
            rows = pl.ds(j // gr * gr * te, gr * te)        # the group's rows of y
            if interpret:
                # no TMA reduction there: the programs run one after another, so a plain
                # read, add and write stands in for it
                o = o_smem.at[slot, pl.ds(0, te)]
                o[...] = y
                o[:, cols] = o[:, cols] + y_gmem[pl.ds(j * te, te), cols]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o.at[:, cols], y_gmem.at[pl.ds(j * te, te), cols])
                plgpu.wait_smem_to_gmem(0)
                return

            # the slot this group writes was last read by the reduction obufs groups back
            @pl.when(i == 0)
            def _():
                plgpu.wait_smem_to_gmem(cfg.obufs - 1, wait_read_only=True)

            if cfg.out_cols:       # TMA wants a contiguous source: the columns repacked
                o_smem[slot] = y
                oc_ref[0][slot, pl.ds(i * te, te)] = o_smem[slot, :, cols]
                src = oc_ref[0].at[slot]
            else:
                o_smem[slot, pl.ds(i * te, te)] = y
                src = o_smem.at[slot]

            @pl.when(i == gr - 1)
            def _():
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(src, y_gmem.at[rows, cols],
                                        reduction_op=None if cfg.plain_store else "add")

        if cfg.no_epi:
            if interpret:
                raise ValueError("mgpu_mlp: no_epi is a GPU timing split")

            def acc_only(*accs):       # no_epi accumulators, one per part of a tile
                parts = len(accs)
                rows = te // parts
                for acc in accs:
                    acc[...] = zeros((rows, t))

                def down_acc(idx, *tiles):  # (one part: the scale tile comes last, unused)
                    for acc, d_smem in zip(accs, tiles):
                        plgpu.wgmma(acc, conv(d_smem), h_smem)
                    plgpu.wgmma_wait(0)

                if parts == 1:
                    down_pipeline(plgpu, down_acc, cfg, p, d_tf, e)(wd_gmem, sd_gmem)
                else:
                    order = down_order(cfg, p, e)
                    plgpu.emit_pipeline(
                        down_acc, grid=(e // te,), max_concurrent_steps=cfg.stages,
                        in_specs=[plgpu.BlockSpec(
                            (rows, fs), lambda j, q=q: (parts * order(j) + q, p),
                            transforms=d_tf) for q in range(parts)])(*[wd_gmem] * parts)
                total = accs[0][...]
                for acc in accs[1:]:
                    total = total + acc[...]
                o_smem[0, pl.ds(0, rows)] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[0, pl.ds(0, rows)], y_gmem.at[pl.ds(0, rows)],
                                        reduction_op="add")

            if cfg.no_epi > 2 or cfg.no_epi == 2 and (cfg.blocked or (te // 2) % 64):
                raise ValueError(f"mgpu_mlp: no_epi is 1, or 2 with [E, F] down weights and "
                                 f"tile_e a multiple of 128, not {cfg}")
            pl.run_scoped(acc_only, *[plgpu.ACC((te // cfg.no_epi, t), jnp.float32)]
                          * cfg.no_epi)
        else:
            down_pipeline(plgpu, down, cfg, p, d_tf, e)(wd_gmem, sd_gmem)
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((fs, t), jnp.float16, transforms=x_tf),
               plgpu.SMEM((cfg.obufs, te if cfg.out_cols else cfg.group * te, t),
                          jnp.float32, transforms=() if cfg.out_cols else o_tf),
               plgpu.SMEM((2, fs), jnp.float32), plgpu.Barrier(num_barriers=2)]
    if cfg.out_cols:
        scratch.append(plgpu.SMEM((cfg.obufs, cfg.group * te, cfg.out_cols), jnp.float32))
    return launch_into(program, scratch, programs, (xt, w_gu, s_gu, w_d, s_d), y0, interpret)


def down_f(w_d, cfg: Config) -> int:
    if cfg.blocked:
        if w_d.ndim != 3 or w_d.shape[2] != cfg.fs:
            raise ValueError(f"mgpu_mlp: blocked w_d must be [F / {cfg.fs}, E, {cfg.fs}], "
                             f"got {w_d.shape}")
        return w_d.shape[0] * w_d.shape[2]
    return w_d.shape[1]


def down_order(cfg: Config, p, e: int):
    """Program p's step j -> the down tile (rows j * tile_e ... of y) it handles. Without
    `stagger` every program walks the tiles 0, 1, ... in step with the others, so all of
    them reduce-add into the same rows of y at the same time. Staggered, the programs start
    at different groups of `group` tiles, each group's tiles in order."""
    gr = cfg.group
    n = e // cfg.tile_e // gr
    if not cfg.stagger:
        return lambda j: j
    return lambda j: lax.rem(j // gr + p, n) * gr + j % gr


def down_spec(plgpu, cfg: Config, p, tf, order=lambda j: j):
    """Program p's [tile_e, FS] down-weight tiles, step j (tf: their smem transforms)."""
    if cfg.blocked:
        return plgpu.BlockSpec((None, cfg.tile_e, cfg.fs), lambda j: (p, order(j), 0),
                               transforms=tf)
    return plgpu.BlockSpec((cfg.tile_e, cfg.fs), lambda j: (order(j), p), transforms=tf)


def down_pipeline(plgpu, body, cfg: Config, p, tf, e: int):
    """Program p's pipeline over its down-weight tiles and their channel scales:
    body(idx, d_smem [tile_e, FS], sd_smem [tile_e]), idx[0] the tile (down_order)."""
    te = cfg.tile_e
    order = down_order(cfg, p, e)
    return plgpu.emit_pipeline(
        lambda idx, *refs: body((order(idx[0]),), *refs), grid=(e // te,),
        max_concurrent_steps=cfg.stages,
        in_specs=[down_spec(plgpu, cfg, p, tf, order),
                  plgpu.BlockSpec((te,), lambda j: (order(j),))])


def pad_t(x, resid):
    """x, resid [R, E] -> the f16 forms' inputs: x^T [E, T] f16 and y0 [E, T] f32, padded."""
    pad = ((0, T - x.shape[0]), (0, 0))
    return jnp.pad(x, pad).astype(jnp.float16).T, jnp.pad(resid, pad).astype(jnp.float32).T


def block_down(w_d, fs: int):
    """w_d [E, F] -> [F / fs, E, fs]: each F-slice's columns one contiguous block."""
    e, f = w_d.shape
    return w_d.reshape(e, f // fs, fs).transpose(1, 0, 2)


def reference(x, w_gu, s_gu, w_d, s_d, resid):
    """f32 math of the same MLP: x [T, E], resid [T, E] -> [T, E]."""
    f = w_d.shape[1]
    gu = jnp.dot(x.astype(jnp.float32), (w_gu.astype(jnp.float32) * s_gu[:, None]).T)
    h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
    return resid + jnp.dot(h, (w_d.astype(jnp.float32) * s_d[:, None]).T)


def xla_route(x, resid, w_gu, s_gu, w_d, s_d):
    """The model's batch-1 route: fp8_matmul's fused-dequant GEMMs (x padded to 8 rows),
    SiLU * up, the residual add; XLA fuses and splits them as it does in the decode step."""
    from pallas_kernels.fp8_matmul import xla_dequant_matmul
    f = w_d.shape[1]
    gu = xla_dequant_matmul(x, w_gu, s_gu)
    return resid + xla_dequant_matmul(jax.nn.silu(gu[:, :f]) * gu[:, f:], w_d, s_d)


def main(argv=None) -> dict:
    """The probe's sweep (mgpu_mlp_sweep.py)."""
    from bench.probes.mgpu_mlp_sweep import sweep
    return sweep(argv)


if __name__ == "__main__":
    main()
