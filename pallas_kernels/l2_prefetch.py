"""Weights pulled into the L2 cache ahead of the GEMM that reads them, while latency-bound
kernels leave HBM idle.

At batch 1 a decoder layer is four weight-streaming GEMMs with chains of small kernels between
them (8B FP8 step, H200, bench/README.md sixteenth session: RoPE + K/V write 2.6 us, decode
attention 4.4 + combine 2.4, residual add 1.8, RMSNorm 1.8, ...). Those kernels move a few KB;
for their ~13 us per layer HBM sits idle, and each GEMM then starts its stream from cold. The
H200's L2 holds 60 MB. `prefetch` is an identity on a small activation (aliased in and out:
nothing is copied) whose kernel issues `cp.async.bulk.prefetch.L2.global` for the first bytes
of the weights named: one instruction per CHUNK_BYTES, fire and forget (no completion to wait
for), so the kernel ends after issuing and the copies run behind the small kernels that follow.
The GEMM then reads those bytes from L2. Threading an activation through it pins where in the
step it runs.

The asm needs the weights' addresses, which Pallas does not hand to a kernel: the primitive
here (`l2_prefetch_p`) lowers to Triton itself, with the pointer arithmetic of Pallas' own
loads (jax._src.pallas.triton.lowering, a private module: checked on jax 0.10.2 by the CPU
test that lowers it for CUDA, and on the H200's 0.11.2 by the gpu-marked test). The kernel
only runs compiled on the GPU; model code calls it through ops.l2_prefetch, which is a no-op
elsewhere.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import tree_util
from jax.experimental import pallas as pl

from jax._src import core as jax_core
from jax._src import state
from jax._src.state import primitives as sp

from pallas_kernels import pow2_ceil, pow2_divisor, triton_params

CHUNK_BYTES = 4096    # bytes per bulk prefetch (at most; a multiple of 16, as the instruction needs)
PROGRAMS = 8          # programs issuing the prefetches (each issues a few hundred)
NUM_WARPS = 4

l2_prefetch_p = jax_core.Primitive("jaxinfer_l2_prefetch")
l2_prefetch_p.multiple_results = True


@l2_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(*avals_flat, args_tree, size_bytes):
    del avals_flat, args_tree, size_bytes
    # a write effect: a read whose result is unused is dead code to jaxpr DCE
    return [], {state.WriteEffect(0)}


def prefetch_rows(ref, rows, size_bytes: int):
    """Inside a Pallas Triton kernel: prefetch `size_bytes` into L2 from the start of each row
    `rows` (int32 [N]) of the 2-D ref."""
    x_ref, transforms = sp.get_ref_and_transforms(ref, (rows, 0), "prefetch")
    flat, tree = tree_util.tree_flatten((x_ref, transforms))
    l2_prefetch_p.bind(*flat, args_tree=tree, size_bytes=size_bytes)


def _register_lowering():
    """The Triton lowering of l2_prefetch_p (imported lazily: the Triton backend's module)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as tl

    if l2_prefetch_p in tl.triton_lowering_rules:
        return

    @tl.register_lowering(l2_prefetch_p)
    def _lowering(ctx, *args_flat, args_tree, size_bytes):
        block_info, *_ = ctx.block_infos
        ptr, (indexer,) = args_tree.unflatten(args_flat)
        ptrs = tl._compute_pointers_from_indices(ptr, block_info, indexer)
        shape = indexer.get_indexer_shape_static()
        i32 = ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32))
        if size_bytes:
            asm = (f"cp.async.bulk.prefetch.L2.global [$1], {size_bytes};\n"
                   "mov.u32 $0, 0;")
        else:     # one 128-byte line per pointer
            asm = "prefetch.global.L2::evict_last [$1];\nmov.u32 $0, 0;"
        tt_dialect.elementwise_inline_asm([i32], asm, constraints="=r,l", pure=False,
                                          packed_element=1, args=[ptrs])
        return []


def _kernel(x_in, *refs, plans, lines: bool):
    del x_in                # aliased to the output, which is left as it is
    pid = pl.program_id(0)
    for w_ref, (rows, per, chunk) in zip(refs[:-1], plans):
        idx = jnp.minimum(pid * per + jnp.arange(per, dtype=jnp.int32), rows - 1)
        prefetch_rows(w_ref, idx, 0 if lines else chunk)


def chunk_view(w, nbytes: int, max_chunk: int = CHUNK_BYTES):
    """(w viewed as rows of `chunk` bytes, a free reshape; the number of rows covering its
    first `nbytes`; chunk): chunk is the largest power of two <= max_chunk dividing w's
    size, at least the instruction's 16 (else ValueError)."""
    size = w.size * w.dtype.itemsize
    chunk = pow2_divisor(size, max_chunk)
    if chunk < 16:
        raise ValueError(f"{w.shape} {w.dtype}: {size} bytes is not a multiple of 16")
    view = w.reshape(size // chunk, chunk // w.dtype.itemsize)
    return view, min(size // chunk, -(-nbytes // chunk)), chunk


def prefetch(x, weights, nbytes, *, programs: int = PROGRAMS, max_chunk: int = CHUNK_BYTES,
             lines: bool = False):
    """x unchanged (aliased: its buffer comes back); on the way, the first nbytes[i] bytes of
    weights[i] are prefetched into L2 by `programs` programs, at most max_chunk bytes per
    instruction. Compiled on the GPU only (the asm is PTX)."""
    _register_lowering()
    views, plans = [], []
    for w, n in zip(weights, nbytes):
        view, rows, chunk = chunk_view(w, n, 128 if lines else max_chunk)
        if rows:
            views.append(view)
            plans.append((rows, pow2_ceil(-(-rows // programs)), chunk))
    if not views:
        return x
    return pl.pallas_call(
        functools.partial(_kernel, plans=tuple(plans), lines=lines),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(programs,),
        input_output_aliases={0: 0},
        name="jaxinfer_l2_prefetch",
        **triton_params(False, NUM_WARPS, 1),
    )(x, *views)
