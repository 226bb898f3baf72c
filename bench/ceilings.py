"""Hardware ceilings measured in the same run as the numbers they judge (bench/README.md).

    copy_TBps   device-to-device copy (read + write bytes counted)
    read_TBps   read-only reduction: the fastest of READS over the buffer
    gemm_TFLOPs dense matmul rate (bf16 on the GPU, float32 on the CPU)

On the GPU: 4 GiB buffers and an 8192^3 bf16 GEMM; on the CPU sizes small enough
for CI (16 MiB, 512^3). Each kernel first runs WARM_S seconds untimed (GPU clocks ramp up from
idle). An XLA reduction reads below the HBM peak a tuned kernel reaches, so an MBU against
read_TBps can pass 1; `read_candidates_TBps` keeps every candidate's rate.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bench.common import timed

WARM_S = 0.5   # seconds each kernel runs untimed first

# Read-only reductions of a flat uint32 buffer; the row sums write 1/4096 of what they read.
READS = {
    "uint32 sum": lambda a: jnp.sum(a, dtype=jnp.uint32),
    "uint32 row sums of 4096": lambda a: jnp.sum(a.reshape(-1, 4096), axis=1,
                                                 dtype=jnp.uint32),
    "uint32 max": lambda a: jnp.max(a),
}


def sizes() -> tuple[int, int, object]:
    """(buffer bytes, GEMM n, GEMM dtype) for the current backend."""
    if jax.default_backend() == "gpu":
        return 4 << 30, 8192, jnp.bfloat16
    return 16 << 20, 512, jnp.float32


def _warm_timed(fn, reps: int, warm_s: float) -> float:
    """timed(fn, reps) after running fn for warm_s seconds."""
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        fn()
    return timed(fn, reps)


def measure(reps: int = 10, warm_s: float | None = None) -> dict:
    nbytes, n, dtype = sizes()
    warm = (WARM_S if jax.default_backend() == "gpu" else 0.0) if warm_s is None else warm_s
    x = jax.random.bits(jax.random.PRNGKey(1), (nbytes // 4,), jnp.uint32)
    reads = {}
    for name, f in READS.items():
        fn = jax.jit(f)
        reads[name] = round(nbytes / _warm_timed(lambda: fn(x).block_until_ready(), reps,
                                                 warm) / 1e12, 4)
    copy_fn = jax.jit(lambda a: a[::-1])  # reversed: no aliasing or elision shortcut
    copy = _warm_timed(lambda: copy_fn(x).block_until_ready(), reps, warm)
    del x
    ka, kb = jax.random.split(jax.random.PRNGKey(2))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    gemm_fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    gemm = _warm_timed(lambda: gemm_fn(a, b).block_until_ready(), reps, warm)
    best = max(reads, key=reads.get)
    return {"copy_TBps": round(2 * nbytes / copy / 1e12, 4),
            "read_TBps": reads[best],
            "gemm_TFLOPs": round(2 * n ** 3 / gemm / 1e12, 3),
            "read_candidates_TBps": reads,
            "method": f"each kernel run {warm:g} s untimed first; copy: XLA reverse of "
                      f"{nbytes >> 20} MiB; read: the fastest of {', '.join(READS)} over the "
                      f"same ({best}); gemm: {n}^3 {jnp.dtype(dtype).name}"}


if __name__ == "__main__":
    import json
    print(json.dumps(measure(), indent=1))
