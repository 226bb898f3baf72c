"""Pallas GPU kernels: each file holds a kernel, its pallas_call wrapper, a jitted entry with
input validation and a plain-jnp *_reference; attention_block.py holds the block step (and
FP8 numerics) both paged-attention kernels share, tuning.py their block sizes."""
import functools
import os

import jax.numpy as jnp

# experiment switch (not for commit): "each" = one reduction per chunk, the old form
_EACH = os.environ.get("JAXINFER_CHUNK_REDUCE", "once") == "each"


def triton_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """pallas_call's compiler_params for the Triton backend ({} in interpret mode)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as plt   # deprecated in jax 0.11, still there
    return {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def pow2_ceil(n: int) -> int:
    """Smallest power of two >= n (n >= 1): Triton's tile sizes."""
    return 1 << (n - 1).bit_length()


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def chunked_sum(parts):
    """The row sums ([M]) of equal-shaped [M, BF] chunks of one row block: the chunks are
    added elementwise first and reduced across the row once. In a Triton kernel each
    jnp.sum(axis=1) over a row spread across warps is one round through shared memory and a
    barrier; one per chunk put those in series (module docs of rmsnorm.py, norm_quant.py)."""
    if _EACH:
        return functools.reduce(jnp.add, [jnp.sum(p, axis=1) for p in parts])
    return jnp.sum(functools.reduce(jnp.add, parts), axis=1)


def chunked_max(parts):
    """chunked_sum for the row maxima."""
    if _EACH:
        return functools.reduce(jnp.maximum, [jnp.max(p, axis=1) for p in parts])
    return jnp.max(functools.reduce(jnp.maximum, parts), axis=1)
