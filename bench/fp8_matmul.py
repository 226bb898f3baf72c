"""FP8-weight matmul: jaxinfer's fp8_linear vs XLA bf16 vs XLA with the fp8 dequant left to it.

    python bench/fp8_matmul.py --out bench/results/fp8_matmul.json

Every implementation runs in this one process on the same random data. Each timed call is one
jitted program applying the op to R different weight buffers (R x fp8 bytes >= --rotate-mb, so
the 60 MB L2 never holds the next weight), issued back to back; us = median over samples of
wall time / (calls * R). On the GPU `us_device` is the device-side time of the same program
(its kernels' and copies' durations under the profiler, per op; bench.profile.device_seconds):
the host clock also counts the idle time between launches, which the model's step (replayed
from a command buffer) mostly does not pay. The targets are read on us_device. `TBps` counts
weight bytes only (fp8: K*N + 4N, bf16: 2KN), the unit the targets are stated in. Each row
also carries its error against the f32 reference.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from bench.common import git_sha
from bench.profile import device_seconds
from checkpoints.fp8 import quantize_linear
from pallas_kernels import fp8_matmul as fm

SHAPES = "4096x6144,4096x4096,4096x28672,14336x4096"   # Llama-3-8B projections, K x N
MS = "1,8,16,32,64,128,2048"
CEILING_ELEMS = 2**30           # 2 GiB of bf16 for the bandwidth ceilings


def xla_bf16(x, w, _w_q, _scale):
    return jnp.dot(x, w)


def xla_fp8_dequant(x, _w, w_q, scale):
    """What XLA does with fp8 weights when nobody helps: upcast, bf16 GEMM, scale after."""
    return fm.xla_dequant_matmul(x, w_q, scale)


def xla_fp8_dequant_pad8(x, _w, w_q, scale):
    """M = 1 padded to 8 rows for XLA's fused-dequant GEMM (it picks another emitter at M=8)."""
    return fm.xla_dequant_matmul(jnp.pad(x, ((0, 8 - x.shape[0]), (0, 0))), w_q, scale)[:1]


def jaxinfer(x, _w, w_q, scale):
    return fm.fp8_linear(x, w_q, scale)


def skinny_kernel(x, _w, w_q, scale):
    """The Pallas decode route forced, to show where the dispatch threshold should sit."""
    t = fm.skinny_tiles(x.shape[0], x.shape[1], w_q.shape[0])
    return fm.skinny_fp8_matmul(x, w_q[None], scale[None], jnp.zeros((1,), jnp.int32), t)


def tensor_core_route(x, _w, w_q, scale):
    return fm.tensor_core_fp8_matmul(x, w_q, scale)


def tc_f32_product(x, _w, w_q, scale):
    """The tensor-core route with the GEMM writing f32 (the route's product before bf16)."""
    return fm.tensor_core_fp8_matmul(x, w_q, scale, product_dtype=jnp.float32)


def tc_tensor_scale(x, _w, w_q, scale):
    """The tensor-core route with one activation scale per call and a bf16 product."""
    return fm.tensor_core_fp8_matmul(x, w_q, scale, product_dtype=jnp.bfloat16,
                                     per_token=False)


VARIANTS = {"tc_f32_product": tc_f32_product, "tc_tensor_scale": tc_tensor_scale}


def _dequant_padded(x, w_q, scale, rows, barrier=False, product=jnp.float32):
    xp = jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))
    if barrier:      # the pad materialized: XLA cannot fuse it into the GEMM's operand
        xp = lax.optimization_barrier(xp)
    y = lax.dot_general(xp, w_q.astype(jnp.bfloat16), fm._CONTRACT_K,
                        preferred_element_type=product)
    return (y.astype(jnp.float32) * scale[None, :]).astype(x.dtype)[:x.shape[0]]


# M = 1 variants of the fused-dequant route (fp8_linear pads to DEQUANT_PAD_M = 8 rows):
# the M = 8 GEMM measured faster alone than the padded M = 1 call (4096x28672: 33.6 vs 36.2
# us, bench/results/fp8_matmul.json), so the pad's fusion into the GEMM is a suspect.
M1_VARIANTS = {
    "pad8_barrier": lambda x, _w, w_q, s: _dequant_padded(x, w_q, s, 8, barrier=True),
    "pad16": lambda x, _w, w_q, s: _dequant_padded(x, w_q, s, 16),
    "pad16_barrier": lambda x, _w, w_q, s: _dequant_padded(x, w_q, s, 16, barrier=True),
    "pad8_bf16_product": lambda x, _w, w_q, s: _dequant_padded(x, w_q, s, 8,
                                                               product=jnp.bfloat16),
}


def _ksplit(a, b, s, a_k, b_k):
    """a and b with their K axes (a_k, b_k) viewed as (s, K/s): a free reshape of each
    row-major operand, no transpose. dot_general then batches over the s slices, so a GEMM
    with too few output tiles for 132 SMs runs s times as many programs, and the s partial
    products are added after (split-K by hand). Whether XLA copies an operand to make the
    batch axis major shows in each row's `hlo` (bench rows with --ksplit)."""
    def view(t, k):
        return t.reshape(t.shape[:k] + (s, t.shape[k] // s) + t.shape[k + 1:])
    dims = (((a_k + 1,), (b_k + 1,)), ((a_k,), (b_k,)))
    return view(a, a_k), view(b, b_k), dims


def bf16_ksplit(x, w, _w_q, _scale, s):
    """x [M, K] @ w [K, N] in s K-slices: [s, M, N] f32 partials, summed."""
    a, b, dims = _ksplit(x, w, s, 1, 0)
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).sum(0).astype(
        x.dtype)


def dequant_pad8_ksplit(x, _w, w_q, scale, s):
    """The M <= 64 fused-dequant route (M < 8 padded to 8 rows) in s K-slices."""
    xp = jnp.pad(x, ((0, max(0, 8 - x.shape[0])), (0, 0)))
    a, b, dims = _ksplit(xp, w_q.astype(jnp.bfloat16), s, 1, 1)
    y = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).sum(0)
    return (y * scale[None, :]).astype(x.dtype)[:x.shape[0]]


def tc_ksplit(x, _w, w_q, scale, s):
    """The tensor-core route (cuBLASLt FP8) in s K-slices: bf16 partials, summed in f32 by
    the epilogue that applies the scales."""
    x_q, x_scale = fm.tc_quantize(x)
    a, b, dims = _ksplit(x_q, w_q, s, 1, 1)
    y = lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16)
    return fm.tc_scaled(y.astype(jnp.float32).sum(0), x_scale, scale, x.dtype)


def tc_transposed(x, _w, w_q, scale):
    """The tensor-core route computing y^T = w_q x_q^T ([N, M]: cuBLASLt sees M and N
    swapped and may tile them otherwise), transposed back by the scaling epilogue."""
    x_q, x_scale = fm.tc_quantize(x)
    y = lax.dot_general(w_q, x_q, fm._CONTRACT_K, preferred_element_type=jnp.bfloat16)
    return fm.tc_scaled(y.T, x_scale, scale, x.dtype)


def ksplit_variants(m: int, splits) -> dict:
    """bf16 and FP8 K-split variants at M (the FP8 one on the route fp8_linear takes at M),
    and for M > DEQUANT_MAX_M the transposed tensor-core product."""
    fp8 = dequant_pad8_ksplit if m <= fm.DEQUANT_MAX_M else tc_ksplit
    out = {} if m <= fm.DEQUANT_MAX_M else {"tc_transposed": tc_transposed}
    for s in splits:
        out[f"xla_bf16_k{s}"] = functools.partial(bf16_ksplit, s=s)
        out[f"{'dequant' if m <= fm.DEQUANT_MAX_M else 'tc'}_k{s}"] = functools.partial(fp8, s=s)
    return out


def hlo_kernels(fn, x, weight) -> dict:
    """What one call compiles to: kernels by kind and custom-call targets (a copy or
    transpose of the weight would show here as an extra fusion)."""
    from bench import hlo
    text = jax.jit(fn).lower(x, *weight).compile().as_text()
    entry = hlo.analyze(text)["entry"]
    return {"by_kind": entry["by_kind"], "custom_calls": entry["custom_calls"]}


def time_per_op(fn, xs, weights, samples, device: bool = False):
    """Median host-clock seconds per op; the program applies fn once per (x, weight) pair.
    Returns (seconds, device seconds or None, first output): the device time only with
    device=True on a GPU, from the same compiled program run 3 times under the profiler
    (bench.profile.device_seconds)."""
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
    dev = (device_seconds(lambda: [run(xs, weights) for _ in range(3)], 3 * len(xs))
           if device else None)
    return statistics.median(times), dev, out[0]


def rel_err(y, ref):
    y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def make_weights(key, k, n, count):
    """count independent (w bf16 [K, N], w_q fp8 [N, K], scale [N]) triples."""
    out = []
    for i in range(count):
        w = jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02
        out.append((w.astype(jnp.bfloat16), *quantize_linear(w)))
    return jax.block_until_ready(out)


def bench_shape(k, n, ms, args, rows):
    key = jax.random.PRNGKey(k * 31 + n)
    count = min(args.max_rotate, max(2, math.ceil(args.rotate_mb * 2**20 / (k * n))))
    weights = make_weights(key, k, n, count)
    for m in ms:
        xs = [jax.random.normal(jax.random.fold_in(key, 1000 + m * 64 + i), (m, k),
                                jnp.bfloat16) for i in range(count)]
        ref_fp8 = fm.fp8_linear_reference(xs[0], weights[0][1], weights[0][2])
        ref_bf16 = jnp.dot(xs[0].astype(jnp.float32), weights[0][0].astype(jnp.float32),
                           precision=lax.Precision.HIGHEST)
        impls = {"jaxinfer": jaxinfer, "xla_bf16": xla_bf16, "xla_fp8_dequant": xla_fp8_dequant}
        # the routes fp8_linear did not take at this M, to show where its thresholds belong
        if fm.PALLAS_MAX_M < m <= 128 and fm.skinny_tiles(m, k, n) is not None:
            impls["skinny_kernel"] = skinny_kernel
        if m <= fm.DEQUANT_MAX_M:
            impls["tensor_core_route"] = tensor_core_route
        if m == 1:
            impls["xla_fp8_dequant_pad8"] = xla_fp8_dequant_pad8
        if args.variants:
            impls.update(VARIANTS if m > 1 else M1_VARIANTS)
        if args.ksplit:
            impls.update(ksplit_variants(m, args.ksplit))
        for name, fn in impls.items():
            try:
                sec, dev, y = time_per_op(fn, xs, weights, args.samples, device=True)
            except Exception as e:   # one broken route must not cost the other rows
                rows.append({"impl": name, "M": m, "K": k, "N": n, "error": repr(e)[:400]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            w_bytes = 2 * k * n if name.startswith("xla_bf16") else k * n + 4 * n
            extra = ({"hlo": hlo_kernels(fn, xs[0], weights[0])}
                     if args.ksplit and name not in ("xla_fp8_dequant", "skinny_kernel") else {})
            rows.append({"impl": name, "M": m, "K": k, "N": n, "us": round(sec * 1e6, 2),
                         "TBps": round(w_bytes / sec / 1e12, 3),
                         "TFLOPs": round(2 * m * k * n / sec / 1e12, 1),
                         "rel_err": round(rel_err(y, ref_bf16 if name.startswith("xla_bf16")
                                                  else ref_fp8), 5),
                         "rotated_buffers": count, **extra,
                         **({} if dev is None else {
                             "us_device": round(dev * 1e6, 2),
                             "TBps_device": round(w_bytes / dev / 1e12, 3)})})
            print(json.dumps(rows[-1]), flush=True)
        add_ratios(rows, m, k, n)


# M = 1 tile variants for skinny_tiles, the first the default (tuning.FP8_GEMV). GEMV on
# CUDA cores: bytes in flight per thread are BN*BK/(32*warps)*prefetch, and the [BN, BK] f32
# accumulator (reduce_each_step False) costs that many registers again. tensor_cores: x padded
# to 16 rows, fp8 -> bf16 dots, Triton's software pipeline over num_stages.
TUNE_SHAPES = ("4096x6144", "4096x4096", "4096x28672", "14336x4096")
TUNE = [dict(),
        dict(bn_cap=8, bk_cap=512, num_warps=4, reduce_each_step=False, prefetch=1),
        dict(bn_cap=4, bk_cap=2048, num_warps=4, reduce_each_step=True, prefetch=1),
        dict(bn_cap=8, bk_cap=2048, num_warps=8, reduce_each_step=True, prefetch=1),
        dict(tensor_cores=True, bn_cap=64, bk_cap=128, num_stages=3),
        dict(tensor_cores=True, bn_cap=64, bk_cap=256, num_stages=3),
        dict(tensor_cores=True, bn_cap=128, bk_cap=128, num_stages=4),
        dict(tensor_cores=True, bn_cap=32, bk_cap=256, num_stages=4),
        dict(tensor_cores=True, bn_cap=128, bk_cap=256, num_warps=8, num_stages=3)]


def tune(args, rows, on_shape=lambda: None):
    """GEMV tile variants of the decode kernel, to set skinny_tiles' defaults from data."""
    for shape in TUNE_SHAPES:
        k, n = (int(v) for v in shape.split("x"))
        count = min(args.max_rotate, max(2, math.ceil(args.rotate_mb * 2**20 / (k * n))))
        weights = make_weights(jax.random.PRNGKey(7), k, n, count)
        xs = [jax.random.normal(jax.random.PRNGKey(i), (1, k), jnp.bfloat16)
              for i in range(count)]
        ref = fm.fp8_linear_reference(xs[0], weights[0][1], weights[0][2])
        for variant in TUNE:
            t = fm.skinny_tiles(1, k, n, **variant)
            row = {"impl": "tune", "M": 1, "K": k, "N": n, "tensor_cores": t.mp > 1,
                   "bn": t.bn, "bk": t.bk, "splits": t.splits, "num_warps": t.num_warps,
                   "num_stages": t.num_stages, "reduce_each_step": t.reduce_each_step,
                   "prefetch": t.prefetch}
            try:
                sec, _, y = time_per_op(functools.partial(_forced_tiles, t=t), xs, weights,
                                        args.samples)
            except Exception as e:
                rows.append({**row, "error": repr(e)[:400]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            rows.append({**row, "us": round(sec * 1e6, 2),
                         "TBps": round((k * n + 4 * n) / sec / 1e12, 3),
                         "rel_err": round(rel_err(y, ref), 5)})
            print(json.dumps(rows[-1]), flush=True)
        on_shape()


def _forced_tiles(x, _w, w_q, scale, t):
    return fm.skinny_fp8_matmul(x, w_q[None], scale[None], jnp.zeros((1,), jnp.int32), t)


def add_ratios(rows, m, k, n):
    same = {r["impl"]: r for r in rows if (r["M"], r["K"], r["N"]) == (m, k, n) and "us" in r}
    for r in same.values():
        for kind in ("", "_device"):
            if f"us{kind}" in r and f"us{kind}" in same.get("xla_bf16", {}):
                r[f"vs_bf16{kind}"] = round(same["xla_bf16"][f"us{kind}"] / r[f"us{kind}"], 3)


def ceilings():
    """Bandwidth ceilings in this run: a read-only reduction and an XLA elementwise pass."""
    a = jax.random.normal(jax.random.PRNGKey(0), (CEILING_ELEMS,), jnp.bfloat16)
    read, _, _ = time_per_op(lambda x, w: jnp.sum(x, dtype=jnp.float32), [a], [(a,)], 5)
    copy, _, _ = time_per_op(lambda x, w: x + 1, [a], [(a,)], 5)
    return {"read_TBps": round(a.nbytes / read / 1e12, 3),
            "xla_elementwise_TBps": round(2 * a.nbytes / copy / 1e12, 3)}


def cublaslt_f8_in_hlo(k=4096, n=4096, m=2048):
    x = jnp.zeros((m, k), jnp.bfloat16)
    w_q = jnp.zeros((n, k), fm.FP8_DTYPE)
    hlo = fm.fp8_linear.lower(x, w_q, jnp.zeros((n,), jnp.float32)).compile().as_text()
    return "__cublas$lt$matmul$f8" in hlo


def add_timing_args(p: argparse.ArgumentParser, shapes: bool = True) -> None:
    """The flags of the benches that time ops this way (time_per_op over rotated buffers):
    this one, bench/gemv.py, bench/swiglu_quant.py."""
    p.add_argument("--out", required=True, help="results JSON path")
    if shapes:
        p.add_argument("--shapes", default=SHAPES, help="comma-separated KxN")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--rotate-mb", type=float, default=256.0)
    p.add_argument("--max-rotate", type=int, default=16)
    p.add_argument("--git", default=None, help="commit to record (default: git rev-parse)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p)
    p.add_argument("--ms", default=MS, help="comma-separated token counts M")
    p.add_argument("--tune", action="store_true", help="also time GEMV tile variants (M=1)")
    p.add_argument("--tune-only", action="store_true", help="only the tile variants")
    p.add_argument("--variants", action="store_true",
                   help="also time the tensor-core route's epilogue variants (M > 1: "
                        + ", ".join(VARIANTS) + ") and the padded M = 1 route's ("
                        + ", ".join(M1_VARIANTS) + ")")
    p.add_argument("--ksplit", default="",
                   help="comma-separated K-split counts S: also time bf16 and the FP8 route's "
                        "GEMMs over S K-slices with a batch axis (xla_bf16_kS, dequant_kS / "
                        "tc_kS), each row with its compiled kernels")
    args = p.parse_args(argv)
    args.ksplit = [int(v) for v in args.ksplit.split(",") if v]
    ms = [int(v) for v in args.ms.split(",")]
    result = {"suite": "fp8_matmul", "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "git": git_sha(args.git),
              "date": datetime.date.today().isoformat(),
              "command": " ".join(["python -m bench.fp8_matmul"] + sys.argv[1:]),
              "ceilings": ceilings(),
              "pallas_max_m": fm.PALLAS_MAX_M, "dequant_max_m": fm.DEQUANT_MAX_M,
              "checks": {"cublaslt_f8_in_prefill_hlo": cublaslt_f8_in_hlo()},
              "rows": []}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for shape in ([] if args.tune_only else args.shapes.split(",")):
        k, n = (int(v) for v in shape.split("x"))
        bench_shape(k, n, ms, args, result["rows"])
        write(args.out, result)   # after every shape: a timeout keeps what was done
    if args.tune or args.tune_only:
        result["tune"] = []
        tune(args, result["tune"], lambda: write(args.out, result))
        write(args.out, result)
    for r in result["rows"]:
        if "us" not in r:
            print(f'{r["impl"]:>18} M={r["M"]:>5} {r["K"]:>5}x{r["N"]:<5} {r["error"][:80]}')
            continue
        dev = ("" if "us_device" not in r else
               f'  device {r["us_device"]:>8.1f} us {r["TBps_device"]:>5.2f} TB/s '
               f'x{r.get("vs_bf16_device", 0):.2f}')
        print(f'{r["impl"]:>18} M={r["M"]:>5} {r["K"]:>5}x{r["N"]:<5} {r["us"]:>9.1f} us '
              f'{r["TBps"]:>6.2f} TB/s  x{r.get("vs_bf16", 0):.2f} vs bf16  '
              f'err {r["rel_err"]:.1e}{dev}')


def write(path, result):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
