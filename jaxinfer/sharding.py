"""Tensor parallelism with JAX's SPMD machinery: a 1-D `Mesh` over axis "tp", a
`PartitionSpec` for every weight and the KV cache, and XLA (GSPMD) inserting the collectives.

Megatron-style split, one all-reduce per half layer:
    column-parallel  wqkv, w_gateup   output axis sharded (each shard computes its own heads /
                                      its own slice of F; the fused columns are laid out
                                      shard-major by model_state.fused_tree)
    row-parallel     wo, w_down       input axis sharded; the partial sums are all-reduced
    vocab-parallel   embed, lm_head (and its dense copy)   V sharded
    KV cache         [L, K, P, S, D]  K sharded: each device writes and reads only its kv heads
Norms, RoPE frequencies and step inputs are replicated.

What does not divide by tp is replicated instead (never padded): attention (heads and KV
cache) unless both H and K divide — SmolLM2's 9/3 heads at tp=2, the tiny model's 2 kv heads
at tp=4 — the MLP unless F divides, the vocab unless V divides. Replicated attention is
correct, only slower (every device attends over all heads and holds the whole cache).

Pallas kernels cannot be partitioned by GSPMD: ops.py calls them under `shard_map` with the
specs here, so each kernel sees its local heads (or, replicated, all of them).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from pallas_kernels import FP8_DTYPE

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How the model is split. Static (part of the model graph): a change recompiles.
    attn / mlp / vocab: shards of the heads, of F, of V (tp where it divides, else 1)."""

    mesh: Mesh | None = None   # None: one device, no sharding anywhere
    attn: int = 1
    mlp: int = 1
    vocab: int = 1

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


def make_layout(cfg: ModelConfig, tp: int) -> TPLayout:
    """The layout of `cfg` over the first `tp` devices (tp=1: the unsharded TPLayout())."""
    devices = jax.devices()
    if tp > len(devices):
        raise ConfigError(f"tensor_parallel={tp} needs {tp} devices, but only {len(devices)} "
                          f"{devices[0].platform} device(s) are visible")
    if tp == 1:
        return TPLayout()
    mesh = Mesh(np.array(devices[:tp]), (AXIS,))
    heads = cfg.num_heads % tp == 0 and cfg.num_kv_heads % tp == 0
    return TPLayout(mesh, attn=tp if heads else 1,
                    mlp=tp if cfg.intermediate_size % tp == 0 else 1,
                    vocab=tp if cfg.vocab_size % tp == 0 else 1)


# Which layout field shards each linear, and whether it splits its output (column) or its
# input (row). Canonical names (checkpoints.params) and the fused model's names both appear.
_ROLES = {"wq": ("attn", "col"), "wk": ("attn", "col"), "wv": ("attn", "col"),
          "wqkv": ("attn", "col"), "wo": ("attn", "row"),
          "w_gate": ("mlp", "col"), "w_up": ("mlp", "col"), "w_gateup": ("mlp", "col"),
          "w_down": ("mlp", "row"), "lm_head": ("vocab", "col")}
_BIASES = {"bq": "wq", "bk": "wk", "bv": "wv"}


def _spec(ndim: int, axis: int) -> P:
    dims = [None] * ndim
    dims[axis] = AXIS
    return P(*dims)


def linear_spec(layout: TPLayout, name: str, leaf: str, ndim: int, fp8: bool) -> P:
    """Spec of one leaf ("kernel" | "scale" | "bias") of linear `name`. Float kernels are
    [.., in, out]; FP8 kernels [.., out, in] with scale [.., out] (checkpoints/fp8.py)."""
    field, kind = _ROLES[name]
    if getattr(layout, field) == 1:
        return P()
    if leaf != "kernel":    # scale / bias: along out, which only column-parallel splits
        return _spec(ndim, -1) if kind == "col" else P()
    out_axis, in_axis = (-2, -1) if fp8 else (-1, -2)
    return _spec(ndim, out_axis if kind == "col" else in_axis)


def canonical_spec(layout: TPLayout, name: str, ndim: int, fp8: bool) -> P:
    """Spec of one entry of the canonical flat dict (checkpoints.params.param_shapes)."""
    if name == "embed":
        return _spec(ndim, 0) if layout.vocab > 1 else P()
    if name in _BIASES:
        return linear_spec(layout, _BIASES[name], "bias", ndim, fp8)
    if name.endswith("_scale"):
        return linear_spec(layout, name.removesuffix("_scale"), "scale", ndim, fp8)
    if name in _ROLES:
        return linear_spec(layout, name, "kernel", ndim, fp8)
    return P()      # norms


def _key(k) -> str:
    return str(getattr(k, "key", k))


def state_specs(layout: TPLayout, tree):
    """PartitionSpecs for the model state `tree` (a pure dict of arrays or ShapeDtypeStructs
    from checkpoints.model_state.abstract_model), mirroring its structure."""

    def spec(path, leaf):
        names = [_key(k) for k in path]
        if names[0] in ("embed", "lm_head_dense"):     # both [V, E]
            return canonical_spec(layout, "embed", leaf.ndim, False)
        owner = next((n for n in reversed(names) if n in _ROLES), None)
        if owner is None:
            return P()
        # FP8 kernels and the int8 LM head's are [.., out, in]
        out_major = names[-1] == "kernel" and leaf.dtype in (FP8_DTYPE, np.int8)
        return linear_spec(layout, owner, names[-1], leaf.ndim, out_major)

    return jax.tree_util.tree_map_with_path(spec, tree)


def kv_spec(layout: TPLayout) -> P:
    """[L, K, P, S, D] (and the FP8 scales [L, K, P, S]): split by kv head."""
    return P(None, AXIS) if layout.attn > 1 else P()


def fetch(tree):
    """jax.device_get that also reads arrays spanning other processes' devices (several
    processes, one mesh: jax.distributed) when they are replicated: each process reads its
    own copy. A sharded array that spans other processes raises."""
    def local(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.is_fully_replicated:
                raise ValueError(f"cannot fetch an array of shape {x.shape} sharded over "
                                 f"other processes' devices ({x.sharding})")
            return x.addressable_data(0)
        return x
    return jax.device_get(jax.tree.map(local, tree))

