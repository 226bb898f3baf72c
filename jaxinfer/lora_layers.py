"""LoRA on the device: every adapter in use sits in one of `max_loras` fixed slots of one set
of arrays, and each projection's low-rank update is computed for the whole mixed batch in
one pass (the stacked, segmented form Punica and S-LoRA use).

The projections that share an input share one update (GROUPS, as the model fuses them: q, k
and v; gate and up): per group and layer, A [in, N, G*R] holds each module's A side by side
and B [N, G*R, out] each module's B on the block of rows its A feeds and the columns of its
own output in the fused projection's layout (under tensor parallelism shard-major: [n
shards, (own q, k, v)]), zeros elsewhere. N slots, R the engine's max_lora_rank, G the
group's modules; the scaling folded into B. One update is two GEMMs, so a layer's LoRA is 4
pairs of GEMMs, not 7: a step of a few rows is bound by the number of kernels, not by the
bytes of the (small) weights. Each token names its row's slot (-1: no adapter). The update
of x [T, in] takes one of two forms, by the step's static T:
  - two plain GEMMs over every slot,
        (x @ A.reshape(in, N*R')) masked to the token's own slot's columns, @ B.reshape(N*R', out):
    every token reads all N slots' weights and only its own contribute;
  - where 2T < N (few rows beside many slots), each token's own slot gathered, A[:, slot] and
    B[slot]. The gathered copies are written and read again, 2T slots' bytes against the N
    the masked form reads once: fewer bytes only where 2T < N. A GPU step is
    padded to 8 rows; with 8 slots of Llama-3-8B's shape its batch-1 step took 7.49 ms in
    the gathered form against 5.50 ms without LoRA, while the masked form adds 1.31 ms to
    a batch-64 step (bench/results/lora.json).
On one GPU with Pallas, decode steps of a few rows run the update and its add in two kernels
instead (pallas_kernels/lora.py; Routes.lora_kernel) that read only the slots the step's rows
use, for the groups where they measured faster (`lora_kernels.faster`); the forms above
serve everything else: larger steps, tensor parallelism, scanned layers. Where the fused
decode front projects q/k/v inside the attention kernel, their update joins the split-K
products that kernel sums (`add_to_partials`).
Writing an adapter into a slot (`write_slot`) is a program of its own with the slot as a
value: swapping adapters never recompiles. Scanned models keep each array with a leading L
axis (`stacked`), unrolled ones a dict per layer (read in place, as their base weights are).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.lora import LoRAAdapter, module_shapes
from pallas_kernels import lora as lora_kernels

# group -> (its modules in the fused projection's order, the layout axis that shards it)
GROUPS = {"qkv": (("q", "k", "v"), "attn"), "o": (("o",), "attn"),
          "gateup": (("gate", "up"), "mlp"), "down": (("down",), "mlp")}


def group_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """group -> (in, modules, out): its input width, how many modules share it, and the
    width of their fused output."""
    shapes = module_shapes(cfg)
    return {g: (shapes[mods[0]][0], len(mods), sum(shapes[m][1] for m in mods))
            for g, (mods, _) in GROUPS.items()}


def allocate(cfg: ModelConfig, engine: EngineConfig, dtype, unrolled: bool, sharding=None):
    """All slots empty (zeros): group -> (A, B), with a leading L axis (scanned), or a
    tuple of such dicts per layer (unrolled). sharding: where they live (tensor parallel:
    replicated on the mesh; GSPMD splits the updates' work beside the sharded projections)."""
    n, r, layers = engine.max_loras, engine.max_lora_rank, cfg.num_layers
    lead = () if unrolled else (layers,)

    def one():
        return {g: (np.zeros(lead + (din, n, k * r), dtype),
                    np.zeros(lead + (n, k * r, dout), dtype))
                for g, (din, k, dout) in group_shapes(cfg).items()}
    weights = tuple(one() for _ in range(layers)) if unrolled else one()
    return jax.device_put(weights) if sharding is None else jax.device_put(weights, sharding)


def host_slot(adapter: LoRAAdapter | None, cfg: ModelConfig, rank: int, dtype,
              shards: dict[str, int] | None = None):
    """group -> (A [L, in, G*R], B [L, G*R, out]) numpy in `dtype`: one slot's weights in
    allocate's layout (module docstring), the adapter zero-padded to rank R, zeros for the
    modules it does not target (all zeros for None). shards: the layout's shard count per
    axis ("attn", "mlp"; the model's TPLayout), which orders each group's output columns as
    the fused projection's; None: 1."""
    shapes, out = module_shapes(cfg), {}
    for g, (din, k, dout) in group_shapes(cfg).items():
        mods, axis = GROUPS[g]
        n = (shards or {}).get(axis, 1)
        a = np.zeros((cfg.num_layers, din, k * rank), dtype)
        b = np.zeros((cfg.num_layers, k * rank, n, dout // n), dtype)
        col = 0
        for i, m in enumerate(mods):
            width = shapes[m][1] // n           # module m's columns in each shard
            if adapter is not None and m in adapter.weights:
                wa, wb = adapter.weights[m]     # [L, in, r], [L, r, out_m]
                rows = slice(i * rank, i * rank + wa.shape[-1])
                a[..., rows] = wa
                b[:, rows, :, col:col + width] = wb.reshape(wb.shape[:2] + (n, width))
            col += width
        out[g] = (a, b.reshape(cfg.num_layers, k * rank, dout))
    return out


@functools.partial(jax.jit, donate_argnums=(0,))
def write_slot(weights, slot, host):
    """`weights` (allocate's form, donated) with slot `slot` (a traced int32) holding `host`
    (host_slot's arrays)."""
    if isinstance(weights, tuple):      # unrolled: one dict per layer
        return tuple({m: (a.at[:, slot].set(host[m][0][i].astype(a.dtype)),
                          b.at[slot].set(host[m][1][i].astype(b.dtype)))
                      for m, (a, b) in layer.items()} for i, layer in enumerate(weights))
    return {m: (a.at[:, :, slot].set(host[m][0].astype(a.dtype)),
                b.at[:, slot].set(host[m][1].astype(b.dtype)))
            for m, (a, b) in weights.items()}


def token_mask(index, num_slots: int, dtype):
    """index [T] i32 (a slot, -1 none) -> [T, N] one-hot in dtype."""
    return (index[:, None] == jnp.arange(num_slots, dtype=index.dtype)[None, :]).astype(dtype)


def delta(x, pair, index):
    """The update of one projection for x [T, in]: pair (A [in, N, R], B [N, R, out]),
    index [T] i32 (each token's slot, -1 none) -> [T, out] in x's dtype."""
    a, b = pair
    t, (din, n, r) = x.shape[0], a.shape
    if 2 * t < n:      # read only the tokens' own slots
        own = jnp.maximum(index, 0)
        xa = jnp.einsum("ti,itr->tr", x, a[:, own].astype(x.dtype),
                        preferred_element_type=jnp.float32)
        xa = (xa * (index >= 0)[:, None].astype(jnp.float32)).astype(x.dtype)
        return jnp.einsum("tr,tro->to", xa, b[own].astype(x.dtype),
                          preferred_element_type=jnp.float32).astype(x.dtype)
    mask = token_mask(index, n, jnp.float32)
    xa = jnp.dot(x, a.reshape(din, n * r).astype(x.dtype), preferred_element_type=jnp.float32)
    xa = (xa.reshape(t, n, r) * mask[:, :, None]).astype(x.dtype)
    return jnp.dot(xa.reshape(t, n * r), b.reshape(n * r, -1).astype(x.dtype),
                   preferred_element_type=jnp.float32).astype(x.dtype)


class StepLoRA(NamedTuple):
    """A layer's share of a step's LoRA: its adapters' weights (group -> (A, B)) and each
    token's slot [T] i32 (-1 none)."""
    weights: dict
    index: jax.Array


def fused_delta(x, lora: StepLoRA, group: str):
    """The update of `group` (GROUPS: "qkv", "o", "gateup", "down") for x [T, in], in the
    fused projection's output layout (XLA's forms)."""
    return delta(x, lora.weights[group], lora.index)


def add_to_partials(partials, x, *, lora: StepLoRA, group: str, widths: tuple[int, ...],
                    scale, routes):
    """partials [S, T, out] f32, the split-K products of x [T, in] and the group's fused
    weight that the fused decode front sums and then multiplies by the FP8 channel `scale`
    [out] (None: bf16 weights), with the group's update of x added to part 0 (divided by
    `scale`): the front's sum is then the projection plus its update. x may be the RMSNorm's
    rows before their per-row factor (the folded norm): the update is linear in x, so the
    factor the front applies to the sum is its too. The kernels take it where
    routes.lora_kernel (unscaled weights; add_update's rule), XLA's form elsewhere."""
    if scale is None and _kernels_take(x, lora, group, widths, routes):
        a, b = lora.weights[group]
        return lora_kernels.lora_update(partials, x, a, b, lora.index, widths=tuple(widths),
                                        interpret=routes.interpret)
    d = fused_delta(x, lora, group).astype(jnp.float32)
    return partials.at[0].add(d if scale is None else d / scale.astype(jnp.float32))


def add_update(y, x, lora: StepLoRA, group: str, widths: tuple[int, ...], routes):
    """y [T, out] (the group's fused projection of x [T, in]) plus its LoRA update. widths:
    the group's modules' output widths in y's column order (the kernels' blocks); the
    kernels run where routes.lora_kernel (the decoder clears it where they cannot)."""
    if _kernels_take(x, lora, group, widths, routes):
        a, b = lora.weights[group]
        return lora_kernels.lora_update(y, x, a, b, lora.index, widths=tuple(widths),
                                        interpret=routes.interpret)
    return y + fused_delta(x, lora, group)


def _kernels_take(x, lora: StepLoRA, group: str, widths, routes) -> bool:
    """Whether the group's update of x runs in the Pallas kernels: routes.lora_kernel and
    the shapes where they measured faster (lora_kernels.faster)."""
    a = lora.weights[group][0]
    return routes.lora_kernel and lora_kernels.faster(
        x.shape[0], a.shape[-1] // len(widths), x.shape[1], widths, a.shape[1])
