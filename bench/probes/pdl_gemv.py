"""Does a Mosaic GPU FP8 GEMV that loads its weights before `griddepcontrol.wait` shorten a
chain of batch-1 layers? A probe.

    python -m bench.probes.pdl_gemv [--layers 32] [--impls xla,mgpu,pdl,...] [--out FILE]

The batch-1 FP8 step loses ~3 us per GEMM against its byte time (bench/README.md,
thirty-fifth and thirty-seventh sessions): XLA's GEMMs, launched with PDL, still wait for
their predecessor at their first instruction, so each starts its weight stream cold. A
kernel that issues its first weight copies, then waits for the activations, overlaps the
previous kernel's tail (a norm, a residual add) with its own ramp. XLA adds no wait to a
Mosaic GPU kernel (it compiles none of its code), and jax >= 0.11 launches a Pallas Mosaic
GPU kernel that calls `plgpu.griddepcontrol_wait` with programmatic stream serialization.

The kernel (`gemv`): y^T [splits, N, T] f32 partials = W [N, K] e4m3 . x^T [K, T], x the
f16 activations padded to T = 8 rows. Each program owns one K range (split) and a stride of
`tile_m`-row output tiles; the weight tiles [tile_m, tile_k] stream through a pipeline of
`stages` TMA copies; x's K range goes to shared memory once per program, in tile_k chunks,
at the first step. With `pdl`, the pipeline's first copies are issued before the program
waits for the previous grid (`griddepcontrol.wait`), x after it, and it then lets the next
grid launch (`launch_dependents`). Each step converts its weight tile to f16 in registers and
issues a wgmma with x's chunk as the B operand.

The chain: `--layers` copies of the 8B layer's GEMMs with the glue between them and no
attention: RMSNorm -> QKV -> (q's slice) -> O -> residual add -> RMSNorm -> gate/up ->
SiLU * up -> down -> residual add. impls: `xla` (the model's batch-1 route,
xla_dequant_matmul), `mgpu` (this kernel without PDL), `pdl` (with it), `pdl_top` (PDL
with the wait before any copy: early launch without the prefetch). Per impl: the
median span of one call on the device (first kernel start to last kernel end, calls
apart), the GEMM kernels' summed duration, how far each GEMM started before its
predecessor ended, and whether the `pdl` chain's output equals `mgpu`'s bit for bit with a
new input every call (a GEMV that read x before the wait would not).

On the CPU (jax 0.10, Mosaic GPU interpret mode, no wait: 0.10 has no interpret rule for
it) the kernel is checked against a reference on small shapes (tests/test_pdl_gemv.py).

H200, jax 0.11.2, 32 layers of the 8B (bench/results/pdl_gemv*.json; bench/README.md,
thirty-eighth session): inside XLA's command buffers (the default) PDL never engages for
the Mosaic kernel: the layer chain takes 2629-2634 us with PDL (either wait) or without
(XLA's route 2272-2281), the GEMV chain 2247-2271 (XLA 2091-2095). Without command
buffers the GEMV chain's PDL GEMVs start 5-6 us (median) before their predecessors end:
2095 / 2118 us against 2479 without PDL and 2283 with the wait first, so the weight
prefetch is worth ~1.3-1.5 us per GEMV, but that run launches from the host (the layer
chain there is host-bound). XLA records a custom call in a command buffer as a traced
child graph (its public sources), which leaves the kernel's PDL launch attribute no
predecessor; the outputs of the PDL chains equal the plain ones bit for bit in every call.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

import jaxinfer  # XLA's PDL flag, as in the engine (imported before JAX uses a device)
from bench.common import new_result, print_table, save
from bench.probes.mgpu_util import GPU, grid_kernel, num_sms, transforms

T = 8                                   # padded token rows of x


@dataclasses.dataclass(frozen=True)
class Config:
    tile_m: int = 64        # output channels per tile (wgmma's M)
    tile_k: int = 256       # K per pipeline step and per x chunk
    stages: int = 4         # weight copies in flight
    splits: int = 2         # K ranges (f32 partials [splits, N, T])
    per_sm: int = 2         # programs per SM (each split gets per_sm * SMs / splits)

    @classmethod
    def parse(cls, text: str) -> "Config":
        return cls(*(int(v) for v in text.split(",")))


# per 8B projection (K x N): configs after bench/results/mgpu_gemv.json's best, sized so that
# x's K range, the weight stages and the output tile fit twice in an SM's shared memory
CONFIGS = {(4096, 6144): Config(64, 256, 4, 2, 2), (4096, 4096): Config(64, 256, 4, 4, 2),
           (4096, 28672): Config(64, 256, 4, 2, 2), (14336, 4096): Config(64, 256, 3, 4, 2)}
DEFAULT = Config() if GPU else Config(64, 64, 2, 2, 1)     # the CPU check's small shapes
PDL_MODES = {"mgpu": "", "pdl": "prefetch", "pdl_top": "top"}   # impl -> gemv's pdl
IMPLS = ("xla", *PDL_MODES)


@functools.partial(jax.jit, static_argnames=("cfg", "pdl", "interpret"))
def gemv(w, x, *, cfg: Config = Config(), pdl: str = "", interpret: bool = False):
    """w [N, K] e4m3, x [T, K] f16 -> [splits, N, T] f32 (unscaled partial products).
    pdl: "" (none), "prefetch" (wait after the first weight copies) or "top" (wait first)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, k = w.shape
    if pdl not in PDL_MODES.values():
        raise ValueError(f"pdl_gemv: pdl must be '', 'prefetch' or 'top', got {pdl!r}")
    if x.shape != (T, k) or x.dtype != jnp.float16:
        raise ValueError(f"pdl_gemv: x must be [{T}, {k}] float16, got {x.shape} {x.dtype}")
    ks = k // cfg.splits
    if n % cfg.tile_m or k % cfg.splits or ks % cfg.tile_k:
        raise ValueError(f"pdl_gemv: {cfg} does not tile w [{n}, {k}]")
    k_iters = ks // cfg.tile_k
    tiles = n // cfg.tile_m
    pps = max(1, min(tiles, num_sms() * cfg.per_sm // cfg.splits))   # programs per split
    programs = pps * cfg.splits
    tf = transforms(plgpu, cfg.tile_k, 8)
    x_tf = transforms(plgpu, cfg.tile_k, 16)
    scratch = [plgpu.SMEM((cfg.tile_m, T), jnp.float32),
               plgpu.SMEM((k_iters, T, cfg.tile_k), jnp.float16, transforms=x_tf),
               plgpu.Barrier(num_barriers=k_iters)]

    def body(w_gmem, x_gmem, o_gmem, o_smem, x_smem, bars):
        pid = lax.axis_index("p")
        split, first = pid // pps, pid % pps
        mine = (tiles - first + pps - 1) // pps       # tiles first, first + pps, ...

        def tile_of(g):
            return first + (g // k_iters) * pps, g % k_iters

        def w_index(g):
            m, kk = tile_of(g)
            return m, split * k_iters + kk

        def load_x():
            if pdl == "prefetch" and not interpret:
                plgpu.griddepcontrol_wait()
            for i in range(k_iters):
                off = split * ks + i * cfg.tile_k
                plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(off, cfg.tile_k)], x_smem.at[i],
                                        bars.at[i])
            for i in range(k_iters):
                plgpu.barrier_wait(bars.at[i])
            if pdl and not interpret:
                plgpu.griddepcontrol_launch_dependents()

        def store(m, value):
            plgpu.wait_smem_to_gmem(0)
            o_smem[...] = value
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[split, pl.ds(m * cfg.tile_m, cfg.tile_m)])

        if pdl == "top" and not interpret:
            plgpu.griddepcontrol_wait()
        pipeline = functools.partial(
            plgpu.emit_pipeline, grid=(mine * k_iters,),
            in_specs=[plgpu.BlockSpec((cfg.tile_m, cfg.tile_k), w_index, transforms=tf)],
            max_concurrent_steps=cfg.stages)

        if interpret:
            # 0.10's interpret mode takes no register wgmma operand or accumulator store:
            # the same pipeline, x chunks and indexing with a plain dot.
            def step_i(idx, w_smem, acc):
                m, kk = tile_of(idx[0])
                pl.when(idx[0] == 0)(load_x)
                a = w_smem[...].astype(jnp.float32)
                b = x_smem[kk].astype(jnp.float32).T
                acc = jnp.where(kk == 0, 0.0, acc) + jnp.dot(a, b)
                pl.when(kk == k_iters - 1)(lambda: store(m, acc))
                return acc

            pipeline(step_i, init_carry=jnp.zeros((cfg.tile_m, T), jnp.float32))(w_gmem)
        else:
            def acc_scope(acc_ref):
                def step(idx, w_smem):
                    m, kk = tile_of(idx[0])
                    pl.when(idx[0] == 0)(load_x)

                    @pl.when(kk == 0)
                    def _():
                        acc_ref[...] = jnp.zeros((cfg.tile_m, T), jnp.float32)

                    a = w_smem[...].astype(jnp.float16)
                    plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_smem.at[kk], (1, 0)))
                    plgpu.wgmma_wait(0)
                    pl.when(kk == k_iters - 1)(lambda: store(m, acc_ref[...]))

                pipeline(step)(w_gmem)

            pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, T), jnp.float32))
        plgpu.wait_smem_to_gmem(0)

    return grid_kernel(body, jax.ShapeDtypeStruct((cfg.splits, n, T), jnp.float32), programs,
                       scratch, interpret)(w, x)


def _mosaic(impl: str, w_q, x8, interpret: bool, configs):
    """This kernel for a Mosaic impl, with the config of w_q's shape: [splits, N, T]."""
    cfg = (configs or CONFIGS).get((w_q.shape[1], w_q.shape[0]), DEFAULT)
    return gemv(w_q, x8, cfg=cfg, pdl=PDL_MODES[impl], interpret=interpret)


def linear(impl: str, h, w_q, scale, interpret: bool = False, configs=None):
    """h [1, K] bf16 -> [1, N] bf16 through one route."""
    from pallas_kernels.fp8_matmul import xla_dequant_matmul
    if impl == "xla":
        x8 = jnp.zeros((T, h.shape[1]), h.dtype).at[:1].set(h)
        return xla_dequant_matmul(x8, w_q, scale)[:1]
    x8 = jnp.zeros((T, h.shape[1]), jnp.float16).at[:1].set(h.astype(jnp.float16))
    parts = _mosaic(impl, w_q, x8, interpret, configs)
    return (parts[:, :, 0].sum(0) * scale)[None].astype(h.dtype)


def _norm(x):
    """RMSNorm with unit weights (model.RMSNorm's math)."""
    from pallas_kernels.rmsnorm import add_rmsnorm_reference
    return add_rmsnorm_reference(x, jnp.ones(x.shape[-1:], x.dtype), eps=1e-5)[1]


def chain(impl: str, x, layers, interpret: bool = False, configs=None):
    """The layers' GEMMs and glue (no attention) on x [1, E] bf16."""
    lin = functools.partial(linear, impl, interpret=interpret, configs=configs)
    e = x.shape[1]
    for qkv, o, gu, d in layers:
        q = lin(_norm(x), *qkv)[:, :e]
        x = x + lin(q, *o)
        g, u = jnp.split(lin(_norm(x), *gu), 2, axis=1)
        x = x + lin(jax.nn.silu(g) * u, *d)
    return x


def chain_gemv(impl: str, x, layers, interpret: bool = False, configs=None):
    """The layers' GEMMs alone, back to back, each on a fixed input made from x (no glue
    kernel between them: a PDL GEMV's predecessor is the previous GEMV, which lets it
    launch once its x is in shared memory). Returns every GEMM's raw output."""
    from pallas_kernels.fp8_matmul import xla_dequant_matmul
    xs = {}
    outs = []
    for layer in layers:
        for w_q, scale in layer:
            k = w_q.shape[1]
            if k not in xs:
                row = jnp.resize(x[0], (k,))
                xs[k] = jnp.zeros((T, k), jnp.float16).at[0].set(row.astype(jnp.float16))
            outs.append(xla_dequant_matmul(xs[k].astype(jnp.bfloat16), w_q, scale)
                        if impl == "xla" else _mosaic(impl, w_q, xs[k], interpret, configs))
    return outs


def make_layers(count: int, e: int, f: int, q: int, key):
    """count layers of random e4m3 weights [N, K] with channel scales (QKV, O, gate/up, down)."""
    shapes = [(q, e), (e, e), (2 * f, e), (e, f)]
    out = []
    for i in range(count):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        out.append(tuple(
            (jax.random.normal(kk, s, jnp.float32).astype(jnp.float8_e4m3fn),
             jnp.full((s[0],), 0.5 / np.sqrt(s[1]), jnp.float32)) for kk, s in zip(ks, shapes)))
    return out


def _calls(events, gap_us: float = 40.0):
    """Split device events, in order of start, into calls: a new call where a kernel starts
    over gap_us after every earlier one ended (the host syncs between calls)."""
    calls, end = [], None
    for e in sorted(events, key=lambda e: e["ts"]):
        if end is None or e["ts"] - end > gap_us:
            calls.append([])
        calls[-1].append(e)
        end = max(end or 0.0, e["ts"] + e["dur"])
    return calls


def _is_gemm(impl: str, name: str) -> bool:
    from bench.profile import category
    return "mosaic" in name.lower() if impl != "xla" else category(name) == "gemm"


def _host(out) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(a, np.float32)) for a in jax.tree.leaves(out)])


def _max_rel_diff(outs, refs) -> float:
    """The largest |out - ref| over the ref's largest value, across calls."""
    return float(max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(outs, refs)))


def measure(impl, layers, x0, calls: int, interpret: bool, ref=None, kind="layer",
            configs=None, xla_ref=None) -> dict:
    from bench.profile import device_events, trace_events
    fn = chain if kind == "layer" else chain_gemv
    run = jax.jit(functools.partial(fn, impl, interpret=interpret, configs=configs))
    xs = jax.block_until_ready([x0 * (1 + 0.01 * i) for i in range(calls)])
    outs = [_host(run(x, layers)) for x in xs]
    row = {"impl": impl, "chain": kind, "layers": len(layers), "calls": calls,
           "configs": {f"{k}x{n}": dataclasses.astuple(c) for (k, n), c in
                       (configs or CONFIGS).items()} if impl != "xla" else None,
           "xla_pdl": jaxinfer.PDL_FLAG in os.environ.get("XLA_FLAGS", ""),
           "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if ref is not None:
        row["equal_to_ref_calls"] = sum(int(np.array_equal(a, b)) for a, b in zip(outs, ref))
        row["max_rel_diff_to_ref"] = _max_rel_diff(outs, ref)
    if xla_ref is not None and kind == "layer":      # f16 against bf16 activations
        row["max_rel_diff_to_xla"] = _max_rel_diff(outs, xla_ref)
    if not GPU:
        return row | {"outs": outs}
    host = []
    for _ in range(3):                       # back to back: the host clock per call
        t0 = time.perf_counter()
        jax.block_until_ready([run(x, layers) for x in xs])
        host.append((time.perf_counter() - t0) / calls * 1e6)

    def traced():
        for x in xs:
            jax.block_until_ready(run(x, layers))
    per_call = [c for c in _calls(device_events(trace_events(traced))) if len(c) >= 4]
    spans, gemm_us, early = [], [], []
    for evs in per_call:
        spans.append(max(e["ts"] + e["dur"] for e in evs) - evs[0]["ts"])
        gemm_us.append(sum(e["dur"] for e in evs if _is_gemm(impl, e["name"])))
        for prev, e in zip(evs, evs[1:]):
            if _is_gemm(impl, e["name"]):
                early.append(prev["ts"] + prev["dur"] - e["ts"])
    row.update(host_us_per_call=round(statistics.median(host), 1), calls_traced=len(per_call))
    if not per_call:
        return row | {"outs": outs}
    mid = per_call[len(per_call) // 2]
    row.update(span_us=round(statistics.median(spans), 1), span_us_min=round(min(spans), 1),
               gemm_busy_us=round(statistics.median(gemm_us), 1),
               gemm_started_before_prev_end_us_median=round(statistics.median(early), 2)
               if early else None, kernels_per_call=len(mid),
               # the middle call's first kernels: name, start after the previous end, length
               first_kernels=[(e["name"][:48], round(e["ts"] - (p["ts"] + p["dur"]), 2),
                               round(e["dur"], 2)) for p, e in zip(mid, mid[1:15])])
    return row | {"outs": outs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="xla,mgpu,pdl,pdl_top,xla,mgpu,pdl,pdl_top",
                    help="comma-separated, timed in this order: xla, mgpu, pdl, pdl_top")
    ap.add_argument("--layers", type=int, default=32 if GPU else 1)
    ap.add_argument("--calls", type=int, default=20 if GPU else 2)
    ap.add_argument("--dims", default="4096,14336,6144" if GPU else "256,512,384",
                    help="E,F,QKV width (the 8B: 4096,14336,6144)")
    ap.add_argument("--chain", choices=("layer", "gemv"), default="layer",
                    help="layer: the GEMMs with the glue between them; gemv: the GEMMs alone")
    ap.add_argument("--config", action="append", default=[], metavar="KxN=m,k,stages,splits,"
                    "per_sm", help="a Mosaic GEMV config for one weight shape (repeatable)")
    ap.add_argument("--git", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    interpret = not GPU
    impls = args.impls.split(",")
    if not set(impls) <= set(IMPLS):
        ap.error(f"--impls: unknown {sorted(set(impls) - set(IMPLS))}")
    configs = dict(CONFIGS)
    for text in args.config:
        shape, _, cfg = text.partition("=")
        configs[tuple(int(v) for v in shape.split("x"))] = Config.parse(cfg)
    e, f, q = (int(v) for v in args.dims.split(","))
    layers = make_layers(args.layers, e, f, q, jax.random.PRNGKey(0))
    x0 = jax.random.normal(jax.random.PRNGKey(1), (1, e), jnp.float32).astype(jnp.bfloat16)
    result = new_result("pdl_gemv", args.git, command="python -m bench.probes.pdl_gemv "
                        + " ".join(argv if argv is not None else sys.argv[1:]))
    ref, xla_ref, rows = None, None, []
    for impl in impls:
        row = measure(impl, layers, x0, args.calls, interpret,
                      ref=ref if impl.startswith("pdl") else None, kind=args.chain,
                      configs=configs, xla_ref=None if impl == "xla" else xla_ref)
        outs = row.pop("outs")
        if impl == "mgpu":
            ref = outs
        if impl == "xla":
            xla_ref = outs
        rows.append(row)
        print_table([row], [k for k in row if k not in ("first_kernels", "configs")])
        if args.out:
            save(result, args.out, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
