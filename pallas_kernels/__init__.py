"""Pallas GPU kernels: each file holds a kernel, its pallas_call wrapper, a jitted entry with
input validation and a plain-jnp *_reference; attention_block.py holds the block step (and
FP8 numerics) both paged-attention kernels share, tuning.py their block sizes. Nothing here
imports the rest of jaxinfer: shared numerics (FP8's range, RoPE, the KV pages' layout) live
at this level and the model imports them."""
import math

import jax.numpy as jnp

LOG2E = math.log2(math.e)   # exp(x) = exp2(x * LOG2E): the kernels' softmax and SiLU
FP8_DTYPE = jnp.float8_e4m3fn   # FP8 weights, activations and KV: e4m3
FP8_MAX = 448.0                 # its largest finite value


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
