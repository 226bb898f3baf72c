"""What the Mosaic GPU probes (mgpu_gemv.py, the mgpu_mlp*.py forms and their sweep, pdl_gemv.py,
pdl_pallas.py) share: shared-memory transforms, the launch of a kernel over a 1-D grid or of
one that adds into an output in place, the stand-ins that let jax 0.10's interpret mode run
their kernels on the CPU, and the sweep rows.

jax 0.10 (CPU) and 0.11 (the H200) differ for Mosaic GPU where these probes met it
(bench/README.md, twenty-third session): 0.11 has no Mosaic GPU lowering for a bare
`pallas_call`, and neither version's `plgpu.kernel` takes `input_output_aliases`; a JAX Ref
passed to `pl.kernel` is aliased in and out (`plgpu.kernel`'s custom_vmap wrapper rejects
one). 0.10's interpret mode takes no register wgmma operand, accumulator store, transposed
ref, TMA reduction or Ref argument; the kernels branch on `interpret` for those.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

GPU = jax.default_backend() == "gpu"


def transforms(plgpu, minor_elems: int, bits: int):
    """Tiling + the largest swizzle for a shared-memory tile whose rows hold minor_elems
    elements of `bits` bits (the TMA and wgmma layout)."""
    swizzle = plgpu.find_swizzle(minor_elems * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def num_sms() -> int:
    return jax.devices()[0].core_count if GPU else 2


def zeros_wgmma(shape, interpret: bool):
    """f32 zeros in the WGMMA layout (a plain array in interpret mode)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    z = jnp.zeros(shape, jnp.float32)
    return z if interpret else plgpu.layout_cast(z, plgpu.Layout.WGMMA)


def load_vec(ref, layout, interpret: bool):
    """A shared-memory vector in `layout` (for row or column broadcasts)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout)


def f16(ref):
    return ref[...].astype(jnp.float16)


def _warpgroup(plgpu, threads):
    """(compiler params with warpgroup semantics, the kwargs naming `threads` warpgroups per
    program on axis "wg", or none)."""
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    return params, (dict(num_threads=threads, thread_name="wg") if threads else {})


def grid_kernel(body, out_type, programs: int, scratch, interpret: bool, threads=None):
    """plgpu.kernel over a 1-D grid of `programs` (axis "p"), warpgroup semantics; Mosaic
    GPU's interpret mode on the CPU. threads: warpgroups per program (axis "wg")."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    params, kw = _warpgroup(plgpu, threads)
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kw["interpret"] = InterpretGPUParams()
    return plgpu.kernel(body, out_type=out_type, grid=(programs,), grid_names=("p",),
                        scratch_types=scratch, compiler_params=params, **kw)


def launch_into(program, scratch, programs, args, y0, interpret, threads=None):
    """Run `program(*args, y, *scratch)` on a grid of `programs` (axis "p"), y starting as
    y0 and added into in place: a JAX Ref through pl.kernel on the GPU. 0.10's interpret
    mode takes no Ref argument, and under its pallas_call the result came out P times too
    large with P programs (as if every program were program 0; not checked further): there
    plgpu.kernel, program 0 copying y0 into the output first (its programs run one after
    another). threads: warpgroups per program (axis "wg"; the scratch is shared by them)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:
        def body_i(*refs):
            *ins, y_in, y_out, scr = refs[:len(args) + 2] + (refs[len(args) + 2:],)
            first = lax.axis_index("p") == 0
            if threads:
                first = first & (lax.axis_index("wg") == 0)

            @pl.when(first)
            def _():
                y_out[...] = y_in[...]
            program(*ins, y_out, *scr)

        return grid_kernel(body_i, jax.ShapeDtypeStruct(y0.shape, jnp.float32), programs,
                           scratch, True, threads)(*args, y0)

    def body(*refs):       # scratch through run_scoped, as plgpu.kernel does it
        pl.run_scoped(functools.partial(program, *refs), *scratch,
                      collective_axes="wg" if threads else ())

    params, mesh_kw = _warpgroup(plgpu, threads)
    y = jax.new_ref(y0)
    pl.kernel(body, out_type=(), mesh=plgpu.Mesh(grid=(programs,), grid_names=("p",), **mesh_kw),
              compiler_params=params)(*args, y)
    return y[...]


def with_times(row: dict, sec: float, dev: float | None, gb: float) -> dict:
    """row with the host clock (us) and, where the profiler gave one, the device time
    (us_device) and its rate over gb gigabytes (TBps)."""
    row["us"] = round(sec * 1e6, 2)
    if dev is not None:
        row.update(us_device=round(dev * 1e6, 2), TBps=round(gb / dev / 1e3, 3))
    return row


def try_config(row: dict, measure) -> dict:
    """measure(row) fills row; a config the compiler refuses is recorded in row["error"]
    and the sweep goes on."""
    try:
        measure(row)
    except Exception as e:     # noqa: BLE001 (any refusal is a result of the sweep)
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row
