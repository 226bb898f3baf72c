"""Does XLA launch a Pallas (Triton) kernel with programmatic dependent launch (PDL)?

    python -m bench.probes.pdl_pallas --out pdl_pallas.json

The known way to hide a GEMV's ramp at batch 1 (CUTLASS's Hopper weight-prefetch example, the
serving stacks' low-latency GEMVs) is PDL: the GEMV is launched while its predecessor still
runs, loads its weights, and only then waits (`griddepcontrol.wait`) for the activations.
XLA's own Triton GEMMs wait at their first instruction (by XLA's public insert-pdl pass;
not read from this build's kernels), so jaxinfer would need its own kernels launched with
PDL. This probe asks whether XLA does that for a Pallas custom call carrying the frontend
attribute `xla.pdl_launch` (the one XLA's PDL pass puts on its GEMM fusions; attached here
with jax's `set_xla_metadata`).

Two Pallas kernels in one jitted program: A (132 programs) streams a 138 MB buffer (~180 us
on the H200: one [1024] load per loop step, not a fast stream) and writes y = its sums + c;
B reads y and writes z = y + 1. Variants:
- `plain`: no attribute, no griddepcontrol: B starts after A ends.
- `pdl`: both kernels carry the attribute; A runs `griddepcontrol.launch_dependents` first,
  B runs `griddepcontrol.wait` before reading y (inline PTX whose result feeds B's load
  offsets, so the load cannot move above it).
- `pdl_nowait`: the same without B's wait: if XLA launches B early, B may read y before A
  wrote it (z wrong).
- `mgpu_plain`, `mgpu`, `mgpu_nowait`: the same with B a Mosaic GPU kernel (z = y, by TMA;
  `mgpu` waits with `plgpu.griddepcontrol_wait`). XLA compiles no Mosaic code, so if
  `mgpu_nowait`'s B ends early or copies a stale y, a Mosaic kernel can load its weights
  before its own wait: the route to a PDL weight-prefetch GEMV (bench/README.md,
  thirty-seventh session).
Per variant: B's start minus A's end (us, from the profiler's device events; negative: B
started before A finished), the two kernels' durations, and whether z is right (y + 1; y for
the Mosaic B) across calls with changing c.

H200, jax 0.11.2 (bench/results/pdl_pallas.json, 20 calls each): `plain` B started 0.16 us
before A's end (median), `pdl` 163.0 us before it and `pdl_nowait` 165.6: XLA launches the
marked kernel early. B lasted 1.09 us plain and 164-166 us with the attribute, waiting, also
without its own wait, and every z was right: a wait at the kernel's top that XLA adds
(inferred), so a Pallas (Triton) kernel cannot load anything before it.
The Mosaic B (bench/results/pdl_pallas_mgpu.json): with its own wait it started 9.06 us
before A's end and lasted 11.1 us; without the wait (`mgpu_nowait`) or without PDL it started
1.1 us after A's end, all outputs right: jax 0.11 launches a Mosaic kernel with PDL only when
it calls `griddepcontrol_wait` (the next step: bench/probes/pdl_gemv.py).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from bench.common import new_result, save
from bench.probes.mgpu_util import grid_kernel
from bench.profile import device_events, trace_events
from pallas_kernels import triton_params

PROGRAMS = 132
BLOCK = 1024          # bf16 elements per load
ITERS = 512           # loads per program of A: 132 x 512 x 1024 x 2 B = 138 MB (GPU)


def _ptx(x, op: str):
    """griddepcontrol.<op> run by every element's thread, returning x unchanged (so later
    address math can depend on it)."""
    from jax.experimental.pallas import triton as plt
    return plt.elementwise_inline_asm(
        f"griddepcontrol.{op};\n\tmov.b32 $0, $1;", args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]


def _kernel_a(c_ref, w_ref, y_ref, *, trigger: bool, gpu: bool, iters: int):
    p = pl.program_id(0)
    zero = jnp.zeros((16,), jnp.int32)
    if trigger and gpu:
        zero = _ptx(zero, "launch_dependents")
    base = p * iters * BLOCK + jnp.max(zero)

    def body(i, acc):
        return acc + w_ref[pl.ds(base + i * BLOCK, BLOCK)].astype(jnp.float32)
    acc = lax.fori_loop(0, iters, body, jnp.zeros((BLOCK,), jnp.float32))
    y_ref[pl.ds(p * BLOCK, BLOCK)] = acc + c_ref[0]


def _kernel_b(y_ref, z_ref, *, wait: bool, gpu: bool):
    p = pl.program_id(0)
    zero = jnp.zeros((16,), jnp.int32)
    if wait and gpu:
        zero = _ptx(zero, "wait")
    start = p * BLOCK + jnp.max(zero)
    z_ref[pl.ds(p * BLOCK, BLOCK)] = y_ref[pl.ds(start, BLOCK)] + 1.0


def _mosaic_b(y, *, wait: bool, interpret: bool):
    """B as a Mosaic GPU kernel: z = y, each program's slice through shared memory by TMA,
    after `plgpu.griddepcontrol_wait` when `wait` (XLA compiles no Mosaic code, so any wait
    in it is the kernel's own)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = BLOCK // 128             # a TMA box holds <= 256 elements per dimension

    def body(y_gmem, z_gmem, smem, bar):
        p = lax.axis_index("p")
        if wait:
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(y_gmem.at[p], smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        plgpu.copy_smem_to_gmem(smem, z_gmem.at[p])
        plgpu.wait_smem_to_gmem(0)

    y3 = y.reshape(PROGRAMS, rows, 128)
    scratch = [plgpu.SMEM((rows, 128), jnp.float32), plgpu.Barrier(num_barriers=1)]
    return grid_kernel(body, jax.ShapeDtypeStruct(y3.shape, y.dtype), PROGRAMS, scratch,
                       interpret)(y3).reshape(y.shape)


def program(variant: str, interpret: bool, iters: int = ITERS):
    """The jitted A -> B program of one variant."""
    from jax.experimental.xla_metadata import set_xla_metadata
    gpu = not interpret
    pdl = variant not in ("plain", "mgpu_plain")
    params = triton_params(interpret, 4, 1)
    shape = jax.ShapeDtypeStruct((PROGRAMS * BLOCK,), jnp.float32)

    def call(kernel, name, *args):
        fn = pl.pallas_call(kernel, out_shape=shape, grid=(PROGRAMS,), name=name,
                            interpret=interpret, **params)
        if not pdl:
            return fn(*args)
        with set_xla_metadata(**{"xla.pdl_launch": "true"}):
            return fn(*args)

    def run(c, w):
        y = call(lambda *r: _kernel_a(*r, trigger=pdl, gpu=gpu, iters=iters),
                 f"pdl_a_{variant}", c, w)
        if variant.startswith("mgpu"):
            with (set_xla_metadata(**{"xla.pdl_launch": "true"}) if pdl
                  else contextlib.nullcontext()):
                z = _mosaic_b(y, wait=variant == "mgpu" and gpu, interpret=interpret)
        else:
            z = call(lambda *r: _kernel_b(*r, wait=variant == "pdl", gpu=gpu),
                     f"pdl_b_{variant}", y)
        return y, z
    return jax.jit(run)


def _gaps(events, variant: str):
    """(B's start - A's end) per call, A's and B's durations (us). B: every kernel but A's
    and the copies (the Mosaic kernel's name is not ours to set)."""
    a = sorted((e for e in events if f"pdl_a_{variant}" in e["name"]), key=lambda e: e["ts"])
    b = sorted((e for e in events if f"pdl_a_{variant}" not in e["name"]
                and not e["name"].startswith("Memcpy")), key=lambda e: e["ts"])
    gaps = [eb["ts"] - (ea["ts"] + ea["dur"]) for ea, eb in zip(a, b)]
    return gaps, [e["dur"] for e in a], [e["dur"] for e in b]


def measure(variant: str, interpret: bool, calls: int) -> dict:
    iters = 2 if interpret else ITERS
    run = program(variant, interpret, iters)
    w = jax.random.normal(jax.random.PRNGKey(0), (PROGRAMS * iters * BLOCK,), jnp.bfloat16)
    wrong = 0
    for i in range(calls):                       # a new c each call: stale y shows in z
        y, z = run(jnp.full((1,), float(i), jnp.float32), w)
        plus = 0.0 if variant.startswith("mgpu") else 1.0       # Mosaic's B copies y
        wrong += int(not np.array_equal(np.asarray(z), np.asarray(y) + plus))
    row = {"variant": variant, "calls": calls, "wrong_calls": wrong,
           "kernel_names_seen": []}
    if interpret:
        return row

    def traced():
        outs = [run(jnp.full((1,), float(i), jnp.float32), w) for i in range(calls)]
        jax.block_until_ready(outs)
    events = device_events(trace_events(traced))
    row["kernel_names_seen"] = sorted({e["name"] for e in events})[:6]
    gaps, da, db = _gaps(events, variant)
    if gaps:
        row.update(b_start_minus_a_end_us_median=round(statistics.median(gaps), 2),
                   b_start_minus_a_end_us_min=round(min(gaps), 2),
                   a_us_median=round(statistics.median(da), 2),
                   b_us_median=round(statistics.median(db), 2), pairs=len(gaps))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="plain,pdl,pdl_nowait,plain",
                    help="plain, pdl, pdl_nowait (B in Triton); mgpu_plain, mgpu, "
                         "mgpu_nowait (B in Mosaic GPU)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="CPU check of the kernels")
    ap.add_argument("--git", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = new_result("pdl_pallas", git=args.git, command="python -m bench.probes.pdl_pallas "
                        + " ".join(argv or sys.argv[1:]))
    for v in args.variants.split(","):
        save(result, args.out, [measure(v, args.interpret, args.calls)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
