"""Batched LoRA for decode steps: a projection's low-rank update for a batch whose rows name
different adapters, in two kernels that read only the adapters the batch uses.

Layout (jaxinfer/lora_layers.py): every adapter in use sits in one of N slots; a group of G
projections that share an input (q, k and v; gate and up) keeps A [in, N, G*R] (module g's A
in columns g*R..) and B [N, G*R, out] (module g's B on rows g*R.. and its own output columns,
zeros elsewhere). Each row names its slot in `index` [T] (-1: no adapter).

- `shrink`: xa = x @ A[:, slot] for each row, as S partial sums over slices of `in`. Program
  (n, s) runs only if some row names slot n; it multiplies the rows by slot n's A over split s
  and stores the rows of slot n (a masked store), so no program writes another's rows.
- `expand`: y + xa @ B[slot] in place (y aliased to the output). Program j owns a block of
  output columns, which lies in one module g; it sums the S partials of g's R columns, and for
  each slot a row names, multiplies those rows by the slot's [R, block] of B, skipping the
  zero blocks of the other modules; a step whose rows name no adapter leaves y as it is
  (nothing computed or stored). y may also be [P, T, out], a projection's split-K
  partial products that a later kernel sums (the fused decode front): the update goes into
  part 0 and the other parts are left as they are.

Against XLA's form (lora_layers.delta: two GEMMs over every slot with the rows masked in
between, about 3.5 kernels a group with split-K reductions, conversions and adds) this is 2
kernels a group, and a step whose rows use one adapter reads one slot's weights, not N
(`faster` says where that measured faster).
Rows: T a power of two; T >= 16 uses tensor-core dots, smaller T (a decode step of a few
rows) products on the CUDA cores. R: a power of two >= 16 (tensor-core dots need 16).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pow2_divisor, triton_params

MAX_BLOCK = 128          # expand: output columns per program


@dataclasses.dataclass(frozen=True)
class Tiles:
    bk: int              # shrink: rows of A per loop step
    splits: int          # shrink: S, slices of `in` (one program per slot and slice)
    block: int           # expand: output columns per program
    skip: bool = True    # expand: skip the slots no row names (a branch per slot; without
    #                      it every slot's B is read, 0 x B for the others)
    shrink_warps: int = 4
    expand_warps: int = 4
    stages: int = 2


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def supported(rows: int, rank: int, din: int, widths) -> bool:
    """Whether the kernels take T=rows, R=rank, an input `din` wide and a group of modules
    `widths` wide."""
    return (_pow2(rows) and _pow2(rank) and rank >= 16 and _block(widths, MAX_BLOCK) >= 16
            and pow2_divisor(din, 64) >= 16)


def _block(widths, cap: int) -> int:
    return pow2_divisor(math.gcd(*widths), cap)


def choose_tiles(rows: int, rank: int, din: int, widths, slots: int) -> Tiles:
    """The tiles for T=rows: at 8 rows on an H100, the best of a sweep over BK (64-256), S
    (4-32), warps (1-8), expand blocks (64-256) and stages (1-2) at Llama-3-8B's shapes;
    larger steps take the same rules untuned (the model routes them to XLA)."""
    bk = pow2_divisor(din, 64)
    s = max(1, min(32, 32768 // (rows * rank * 4)))   # expand's partial reads <= 32 KB
    gr = rank * len(widths)
    return Tiles(bk=bk, splits=pow2_divisor(din // bk, s), block=_block(widths, 64),
                 skip=rows <= slots, shrink_warps=4 if _pow2(gr) and gr >= 32 else 2,
                 expand_warps=2)


def faster(rows: int, rank: int, din: int, widths, slots: int) -> bool:
    """Where the model takes the kernels over XLA's form (lora_layers.delta): steps of up to 8
    rows whose shrink programs take at most two loop steps each. On an H100 at Llama-3-8B's
    shapes, 8 slots of rank 16, one row naming an adapter (bench/results/lora_kernels.json):
    q/k/v 1.0x, o 1.36x, gate/up 1.41x, down's 14336-wide input 0.75x; at 64 rows XLA wins
    every group. In the step, base-model rows on a LoRA engine gain the most (the kernels
    skip every slot); see docs/performance.md."""
    if rows > 8 or not supported(rows, rank, din, widths):
        return False
    t = choose_tiles(rows, rank, din, widths, slots)
    return din // (t.splits * t.bk) <= 2


def _product(x, w):
    """x [T, K] @ w [K, C] in f32: tensor cores for T >= 16, else CUDA-core products."""
    if x.shape[0] >= 16:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    return jnp.sum(x.astype(jnp.float32)[:, :, None] * w.astype(jnp.float32)[None, :, :],
                   axis=1)


def _store(ref, value, mask, interpret: bool):
    if interpret:
        ref[...] = jnp.where(mask, value, ref[...])
    else:
        plgpu.store(ref, value, mask=mask)


def _shrink_kernel(index_ref, x_ref, a_ref, o_ref, *, groups: int, rank: int, steps: int,
                   bk: int, interpret: bool):
    n, s = pl.program_id(0), pl.program_id(1)
    mine = index_ref[...] == n                                           # [T]
    # one product over the whole group where G*R is a power of two (Triton's tiles)
    parts = [pl.ds(0, groups * rank)] if _pow2(groups * rank) else \
        [pl.ds(g * rank, rank) for g in range(groups)]

    @pl.when(jnp.sum(mine.astype(jnp.int32)) > 0)
    def _():
        def step(i, accs):
            k = pl.ds((s * steps + i) * bk, bk)
            x = x_ref[:, k]                                              # [T, BK]
            return tuple(acc + _product(x, a_ref[k, n, cols]) for cols, acc in zip(parts, accs))
        accs = lax.fori_loop(0, steps, step, tuple(
            jnp.zeros((x_ref.shape[0], cols.size), jnp.float32) for cols in parts))
        for cols, acc in zip(parts, accs):
            _store(o_ref.at[s, :, cols], acc, mine[:, None], interpret)


def shrink(x, a, index, groups: int, tiles: Tiles, *, interpret: bool = False):
    """x [T, in], a [in, N, G*R] (G = groups), index [T] i32 -> [S, T, G*R] f32 partial sums
    of each row's x @ A[:, index] (rows of index -1 left unwritten)."""
    t, din = x.shape
    _, n, gr = a.shape
    params = triton_params(interpret, num_warps=tiles.shrink_warps, num_stages=tiles.stages)
    return pl.pallas_call(
        functools.partial(_shrink_kernel, groups=groups, rank=gr // groups,
                          steps=din // tiles.splits // tiles.bk, bk=tiles.bk,
                          interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((tiles.splits, t, gr), jnp.float32),
        grid=(n, tiles.splits), interpret=interpret, name="jaxinfer_lora_shrink", **params,
    )(index, x, a)


def _expand_kernel(index_ref, p_ref, b_ref, y_ref, o_ref, *, rank: int, starts, block: int,
                   slots: int, skip: bool, parts: bool):
    j = pl.program_id(0)
    col = j * block
    g = sum((col >= start).astype(jnp.int32) for start in starts[1:]) if len(starts) > 1 \
        else 0
    cols, own = pl.ds(col, block), pl.ds(g * rank, rank)
    index = index_ref[...]                                               # [T]

    @pl.when(jnp.sum((index >= 0).astype(jnp.int32)) > 0)   # else y stays as it is (aliased)
    def _():
        xa = jnp.sum(p_ref[:, :, own], axis=0)                           # [T, R] f32
        acc = jnp.zeros((xa.shape[0], block), jnp.float32)
        for n in range(slots):
            mine = index == n
            rows = jnp.where(mine[:, None], xa, 0.0).astype(b_ref.dtype)
            if not skip:
                acc = acc + _product(rows, b_ref[n, own, cols])
                continue
            acc = lax.cond(jnp.sum(mine.astype(jnp.int32)) > 0,
                           lambda acc=acc, rows=rows, n=n: acc + _product(rows,
                                                                          b_ref[n, own, cols]),
                           lambda acc=acc: acc)
        if parts:                        # y [P, T, out]: the update goes into part 0
            o_ref[0, :, cols] = (y_ref[0, :, cols].astype(jnp.float32)
                                 + acc).astype(o_ref.dtype)
        else:
            o_ref[:, cols] = (y_ref[:, cols].astype(jnp.float32) + acc).astype(o_ref.dtype)


def expand(y, partials, b, index, widths, tiles: Tiles, *, interpret: bool = False):
    """y [T, out] + each row's (sum of `partials` [S, T, G*R]) @ B[index] (b [N, G*R, out];
    rows of index -1 unchanged), written over y; y [P, T, out]: into y[0]. widths: the
    group's modules' output widths in the order of out's columns (their sum is out)."""
    dout = y.shape[-1]
    n, gr, _ = b.shape
    starts = tuple(sum(widths[:i]) for i in range(len(widths)))
    params = triton_params(interpret, num_warps=tiles.expand_warps, num_stages=tiles.stages)
    return pl.pallas_call(
        functools.partial(_expand_kernel, rank=gr // len(widths), starts=starts,
                          block=tiles.block, slots=n, skip=tiles.skip, parts=y.ndim == 3),
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(dout // tiles.block,), input_output_aliases={3: 0}, interpret=interpret,
        name="jaxinfer_lora_expand", **params,
    )(index, partials, b, y)


@functools.partial(jax.jit, static_argnames=("widths", "tiles", "interpret"))
def lora_update(y, x, a, b, index, *, widths: tuple[int, ...], tiles: Tiles | None = None,
                interpret: bool = False):
    """y [T, out] plus each row's LoRA update x @ A[:, slot] @ B[slot] (slot = index[row], -1
    none): the module docstring's layout, `widths` the group's modules' output widths. y
    [P, T, out] (split-K partial products): the update is added to y[0]."""
    t, din = x.shape
    g = len(widths)
    if a.ndim != 3 or a.shape[0] != din or b.ndim != 3 or b.shape[:2] != (a.shape[1],
                                                                          a.shape[2]):
        raise ValueError(f"lora_update: A must be [in={din}, N, G*R] and B [N, G*R, out], got "
                         f"{a.shape} and {b.shape}")
    if (a.shape[2] % g or b.shape[2] != sum(widths) or y.ndim not in (2, 3)
            or y.shape[-2:] != (t, sum(widths))):
        raise ValueError(f"lora_update: {g} modules of widths {widths} do not fit A "
                         f"{a.shape}, B {b.shape} and y {y.shape}")
    if index.shape != (t,) or not supported(t, a.shape[2] // g, din, widths):
        raise ValueError(f"lora_update: rows {t} (index {index.shape}), rank "
                         f"{a.shape[2] // g} and widths {widths} are not supported")
    tiles = tiles or choose_tiles(t, a.shape[2] // g, din, widths, a.shape[1])
    return expand(y, shrink(x, a, index, g, tiles, interpret=interpret), b, index, widths,
                  tiles, interpret=interpret)


def lora_update_reference(y, x, a, b, index):
    """lora_update in plain jnp: each row's own slot gathered, f32 products."""
    if y.ndim == 3:
        return y.at[0].set(lora_update_reference(y[0], x, a, b, index))
    own = jnp.maximum(index, 0)
    xa = jnp.einsum("ti,itr->tr", x.astype(jnp.float32), a[:, own].astype(jnp.float32))
    xa = xa.astype(b.dtype).astype(jnp.float32)
    d = jnp.einsum("tr,tro->to", xa, b[own].astype(jnp.float32))
    return (y.astype(jnp.float32) + jnp.where(index[:, None] >= 0, d, 0.0)).astype(y.dtype)
