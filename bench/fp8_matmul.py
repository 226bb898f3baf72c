"""`jaxinfer bench fp8_matmul`: FP8-weight matmul, jaxinfer's fp8_linear vs XLA bf16 vs XLA
with the FP8 dequant left to it, on Llama-3-8B's projection shapes (K x N) over token counts M.

Every implementation runs in this one process on the same random data. Each timed call is one
jitted program applying the op to R different weight buffers (R x FP8 bytes >= --rotate-mb, so
the 60 MB L2 never holds the next weight), issued back to back; `us` = median over samples of
wall time / (calls x R). On the GPU `us_device` is the same program's kernel time under the
profiler per op (no launch gaps). `TBps` counts weight bytes only (FP8: K*N + 4N, bf16:
2KN); `vs_bf16` = XLA bf16's time / this one. Each row carries its error against the f32
reference (`rel_err`).
"""
from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from bench import ceilings
from bench.common import new_result, print_table, save
from bench.profile import device_seconds
from checkpoints.fp8 import quantize_linear
from pallas_kernels import fp8_matmul as fm

KEYS = ["impl", "M", "K", "N", "us", "TBps", "us_device", "TBps_device", "vs_bf16",
        "vs_bf16_device", "rel_err"]


def xla_bf16(x, w, _w_q, _scale):
    return jnp.dot(x, w)


def xla_fp8_dequant(x, _w, w_q, scale):
    """What XLA does with FP8 weights when nobody helps: upcast, bf16 GEMM, scale after."""
    y = lax.dot_general(x, w_q.astype(x.dtype), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
    return (y * scale[None, :]).astype(x.dtype)


def jaxinfer(x, _w, w_q, scale):
    return fm.fp8_linear(x, w_q, scale)


IMPLS = {"jaxinfer": jaxinfer, "xla_bf16": xla_bf16, "xla_fp8_dequant": xla_fp8_dequant}


def time_per_op(fn, xs, weights, samples: int):
    """(median host-clock seconds per op, device seconds per op or None off the GPU, first
    output); the program applies fn once per (x, weight) pair."""
    run = jax.jit(lambda xs, ws: [fn(x, *w) for x, w in zip(xs, ws)])
    out = jax.block_until_ready(run(xs, weights))
    t0 = time.perf_counter()
    jax.block_until_ready(run(xs, weights))
    calls = max(1, int(0.02 / (time.perf_counter() - t0)))   # ~20 ms of work per sample
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            res = run(xs, weights)
        jax.block_until_ready(res)
        times.append((time.perf_counter() - t0) / (calls * len(xs)))
    dev = device_seconds(lambda: [run(xs, weights) for _ in range(3)], 3 * len(xs))
    return statistics.median(times), dev, out[0]


def rel_err(y, ref) -> float:
    y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def make_weights(key, k: int, n: int, count: int):
    """count independent (w bf16 [K, N], w_q fp8 [N, K], scale [N]) triples."""
    out = []
    for i in range(count):
        w = jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02
        out.append((w.astype(jnp.bfloat16), *quantize_linear(w)))
    return jax.block_until_ready(out)


def bench_shape(k: int, n: int, args) -> list[dict]:
    key = jax.random.PRNGKey(k * 31 + n)
    count = min(args.max_rotate, max(2, math.ceil(args.rotate_mb * 2**20 / (k * n))))
    weights = make_weights(key, k, n, count)
    rows = []
    for m in args.ms:
        xs = [jax.random.normal(jax.random.fold_in(key, 1000 + m * 64 + i), (m, k),
                                jnp.bfloat16) for i in range(count)]
        ref_fp8 = fm.fp8_linear_reference(xs[0], weights[0][1], weights[0][2])
        ref_bf16 = jnp.dot(xs[0].astype(jnp.float32), weights[0][0].astype(jnp.float32),
                           precision=lax.Precision.HIGHEST)
        same = {}
        for name, fn in IMPLS.items():
            row = {"impl": name, "M": m, "K": k, "N": n}
            try:
                sec, dev, y = time_per_op(fn, xs, weights, args.samples)
            except Exception as e:   # one broken route must not cost the other rows
                rows.append({**row, "error": repr(e)[:400]})
                continue
            w_bytes = 2 * k * n if name == "xla_bf16" else k * n + 4 * n
            row.update(us=round(sec * 1e6, 2), TBps=round(w_bytes / sec / 1e12, 3),
                       TFLOPs=round(2 * m * k * n / sec / 1e12, 1),
                       rel_err=round(rel_err(y, ref_bf16 if name == "xla_bf16" else ref_fp8), 5),
                       rotated_buffers=count)
            if dev is not None:
                row.update(us_device=round(dev * 1e6, 2),
                           TBps_device=round(w_bytes / dev / 1e12, 3))
            same[name] = row
            rows.append(row)
        for row in same.values():
            for kind in ("", "_device"):
                base = same.get("xla_bf16", {}).get(f"us{kind}")
                if base and f"us{kind}" in row:
                    row[f"vs_bf16{kind}"] = round(base / row[f"us{kind}"], 3)
    return rows


def cublaslt_f8_in_hlo(k: int = 4096, n: int = 4096, m: int = 2048) -> bool | None:
    """Whether fp8_linear at prefill sizes compiles to cuBLASLt's FP8 GEMM (None off the
    GPU)."""
    if jax.default_backend() != "gpu":
        return None
    x = jnp.zeros((m, k), jnp.bfloat16)
    w_q = jnp.zeros((n, k), jnp.float8_e4m3fn)
    hlo = fm.fp8_linear.lower(x, w_q, jnp.zeros((n,), jnp.float32)).compile().as_text()
    return "__cublas$lt$matmul$f8" in hlo


def run(args) -> int:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    result = new_result(args, ceilings=ceilings.measure(),
                        checks={"cublaslt_f8_in_prefill_hlo": cublaslt_f8_in_hlo()})
    for k, n in shapes:
        save(result, args.out, bench_shape(k, n, args))   # per shape: a timeout keeps the rest
    print_table(result["rows"], KEYS)
    return 0
