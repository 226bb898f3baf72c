"""Hardware ceilings measured in the same run as the numbers they judge (shared/BENCH.md).

    copy_TBps   device-to-device copy (read + write bytes counted)
    read_TBps   read-only reduction (a sum over the buffer)
    gemm_TFLOPs dense matmul rate (bf16 on the GPU, float32 on the CPU)

On the GPU: 4 GiB buffers and an 8192^3 bf16 GEMM, as BENCH.md. On the CPU they just measure
the CPU, at sizes small enough for a CI run (16 MiB, 512^3).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.common import timed


def sizes() -> tuple[int, int, object]:
    """(buffer bytes, GEMM n, GEMM dtype) for the current backend."""
    if jax.default_backend() == "gpu":
        return 4 << 30, 8192, jnp.bfloat16
    return 16 << 20, 512, jnp.float32


def measure(reps: int = 10) -> dict:
    nbytes, n, dtype = sizes()
    x = jax.random.bits(jax.random.PRNGKey(1), (nbytes // 4,), jnp.uint32)
    read_fn = jax.jit(lambda a: jnp.sum(a, dtype=jnp.uint32))
    copy_fn = jax.jit(lambda a: a[::-1])  # reversed: no aliasing or elision shortcut
    read = timed(lambda: read_fn(x).block_until_ready(), reps)
    copy = timed(lambda: copy_fn(x).block_until_ready(), reps)
    del x
    ka, kb = jax.random.split(jax.random.PRNGKey(2))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    gemm_fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    gemm = timed(lambda: gemm_fn(a, b).block_until_ready(), reps)
    return {"copy_TBps": round(2 * nbytes / copy / 1e12, 4),
            "read_TBps": round(nbytes / read / 1e12, 4),
            "gemm_TFLOPs": round(2 * n ** 3 / gemm / 1e12, 3),
            "method": f"copy: XLA reverse of {nbytes >> 20} MiB; read: uint32 sum of the same; "
                      f"gemm: {n}^3 {jnp.dtype(dtype).name}"}
