"""Paged decode attention on one GPU: jaxinfer's Pallas kernel vs the bundled JAX kernel
(jax.experimental.pallas.ops.gpu.paged_attention, [K, P, S, D] pages) vs the XLA reference,
bf16 and FP8 KV, plus the cost of writing the step's new K/V (jaxinfer.kv_cache.write_kv).

    python -m bench.kernels --out bench/results/paged_attention.json [--tune]

Method (shared/BENCH.md): one process; ceilings measured in the same run; random data; each
timed call runs the op over R page tables drawn from one large cache, R chosen so the bytes
touched per call exceed 4x the 60 MB L2; calls are dispatched back to back and the median
over repeats of (elapsed / ops) is reported. Bytes counted: K/V (+ FP8 scales) of every
sequence's live tokens, q and the output. `--tune` first times candidate block sizes on the
target shapes and prints them (the winners go into pallas_kernels/tuning.py by hand).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from jaxinfer.kv_cache import FP8_DTYPE, KVCache, write_kv
from pallas_kernels import tuning
from pallas_kernels.paged_attention import (paged_attention, paged_attention_blocks,
                                            paged_attention_reference)

HQ, HKV, D, PAGE = 32, 8, 128, 16
BATCHES, CONTEXTS = (1, 8, 64, 256), (512, 2048, 8192, 32768)
MAX_TOKENS = 1 << 21       # B*S cap: 8.6 GB of bf16 KV per page-table set
MAX_REF_TOKENS = 1 << 19   # the XLA reference materializes f32 K/V: keep it smaller
TOUCH_BYTES = 256 << 20


def timed(fn, args, reps: int = 15, min_s: float = 2e-3) -> float:
    """Seconds per call: median over reps of back-to-back dispatches lasting >= min_s."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    n = max(1, math.ceil(min_s / max(time.perf_counter() - t, 1e-6)))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(n)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t) / n)
    return statistics.median(samples)


def ceilings() -> dict:
    x = jax.random.bits(jax.random.PRNGKey(1), (1 << 30,), jnp.uint32)  # 4 GiB
    read = timed(jax.jit(lambda a: jnp.sum(a, dtype=jnp.uint32)), (x,))
    copy = timed(jax.jit(lambda a: a[::-1]), (x,))
    return {"read_TBps": round(x.nbytes / read / 1e12, 3),
            "copy_TBps": round(2 * x.nbytes / copy / 1e12, 3),
            "read_method": "XLA uint32 sum over 4 GiB", "copy_method": "XLA reverse, 4 GiB"}


def make_case(batch: int, context: int, fp8: bool, key):
    """One [1, K, P, S, D] cache and R disjoint random page tables [R, B, S/PAGE]."""
    pps = context // PAGE
    per_set = batch * context * HKV * D * (1 if fp8 else 2) * 2
    rot = max(2, min(64, math.ceil(TOUCH_BYTES / per_set)))
    pages = 1 + rot * batch * pps
    ks = jax.random.split(key, 6)
    shape = (1, HKV, pages, PAGE, D)
    dt = FP8_DTYPE if fp8 else jnp.bfloat16
    k = jax.random.normal(ks[0], shape, jnp.bfloat16).astype(dt)
    v = jax.random.normal(ks[1], shape, jnp.bfloat16).astype(dt)
    scales = [jax.random.uniform(s, shape[:-1], jnp.float32, 0.5, 1.5) / 16 for s in ks[2:4]]
    tables = (1 + jax.random.permutation(ks[4], pages - 1)).reshape(rot, batch, pps)
    q = jax.random.normal(ks[5], (batch, HQ, D), jnp.bfloat16)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k, v, (scales if fp8 else [None, None]), tables.astype(jnp.int32), lens


def bytes_moved(batch: int, context: int, fp8: bool) -> int:
    kv = batch * context * HKV * (D * (1 if fp8 else 2) + (4 if fp8 else 0)) * 2
    return kv + 2 * batch * HQ * D * 2


def impls(fp8: bool, blocks=None):
    """name -> f(q, k, v, ks, vs, table, lens) on the [1, K, P, S, D] cache, layer 0."""
    scale = D ** -0.5

    def ours(q, k, v, ks, vs, t, n):
        if blocks is None:
            return paged_attention(q, k, v, 0, n, t, ks, vs, sm_scale=scale)
        return paged_attention_blocks(q, k, v, 0, n, t, ks, vs, sm_scale=scale, blocks=blocks)

    def bundled(q, k, v, ks, vs, t, n):
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pa
        sq = (lambda x: None if x is None else x[0])
        return pa(q * scale, k[0], v[0], t, n, sq(ks), sq(vs))  # bundled has no sm_scale

    def ref(q, k, v, ks, vs, t, n):
        return paged_attention_reference(q, k, v, 0, n, t, ks, vs, sm_scale=scale)
    return {"jaxinfer": ours, "bundled": bundled, "xla_reference": ref}


def rotated(fn):
    """One jitted call = fn over every page table of the rotation."""
    return jax.jit(lambda q, k, v, ks, vs, tables, n: [fn(q, k, v, ks, vs, tables[r], n)
                                                        for r in range(tables.shape[0])])


def time_impl(fn, case) -> float:
    q, k, v, (ks, vs), tables, lens = case
    return timed(rotated(fn), (q, k, v, ks, vs, tables, lens)) / tables.shape[0]


def bench_attention(batch, context, fp8, key) -> list[dict]:
    case = make_case(batch, context, fp8, key)
    nbytes = bytes_moved(batch, context, fp8)
    rows, times = [], {}
    for name, fn in impls(fp8).items():
        if name == "xla_reference" and batch * context > MAX_REF_TOKENS:
            continue
        try:
            times[name] = time_impl(fn, case)
        except Exception as e:  # a failing baseline must not sink the run: record it
            rows.append({"impl": name, "kv_dtype": "fp8" if fp8 else "bf16", "batch": batch,
                         "context": context, "error": f"{type(e).__name__}: {e}"[:300]})
    for name, sec in times.items():
        row = {"impl": name, "kv_dtype": "fp8" if fp8 else "bf16", "batch": batch,
               "context": context, "us": round(sec * 1e6, 2),
               "TBps": round(nbytes / sec / 1e12, 3)}
        if "bundled" in times:
            row["vs_bundled"] = round(times["bundled"] / sec, 3)
        if name == "jaxinfer":
            row["blocks"] = str(tuning.decode_blocks(batch, HKV, context, PAGE,
                                                     1 if fp8 else 2, D))
        rows.append(row)
    return rows


def bench_write_kv(batch: int, fp8: bool, key) -> dict:
    """The step's K/V write: a scatter of B tokens into a donated 1-layer cache."""
    pages, rot = 1 + batch * 2048 // PAGE, 16
    cache = KVCache.allocate(1, HKV, pages, PAGE, D, FP8_DTYPE if fp8 else jnp.bfloat16)
    k, v = (jax.random.normal(s, (rot, batch, HKV, D), jnp.bfloat16) for s in
            jax.random.split(key))
    slots = jax.random.permutation(key, (pages - 1) * PAGE)[:rot * batch] + PAGE
    slots = slots.reshape(rot, batch).astype(jnp.int32)

    @functools.partial(jax.jit, donate_argnums=0)  # donated: the scatter runs in place
    def step(cache, k, v, slots):
        for r in range(rot):
            cache = write_kv(cache, jnp.int32(0), k[r], v[r], slots[r])
        return cache
    cache = jax.block_until_ready(step(cache, k, v, slots))
    samples = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(10):
            cache = step(cache, k, v, slots)
        jax.block_until_ready(cache)
        samples.append((time.perf_counter() - t) / (10 * rot))
    sec = statistics.median(samples)
    return {"impl": "write_kv", "kv_dtype": "fp8" if fp8 else "bf16", "batch": batch,
            "context": 2048, "us": round(sec * 1e6, 2)}


def tune(key) -> None:
    """Time candidate block sizes on the target shapes; print, don't write."""
    cands = [(32, 4, 4), (64, 4, 3), (128, 4, 3), (128, 8, 4)]
    for batch, context in ((64, 2048), (1, 32768)):
        for fp8 in (False, True):
            case = make_case(batch, context, fp8, key)
            base = tuning.decode_blocks(batch, HKV, context, PAGE, 1 if fp8 else 2, D)
            for tok, warps, stages in cands:
                for splits in sorted({base.num_splits, 2 * base.num_splits if batch == 1
                                      else base.num_splits}):
                    blk = tuning.DecodeBlocks(tok, splits, warps, stages)
                    try:
                        sec = time_impl(impls(fp8, blk)["jaxinfer"], case)
                        tbps = bytes_moved(batch, context, fp8) / sec / 1e12
                        print(f"TUNE B={batch} S={context} fp8={fp8} {blk} "
                              f"{sec * 1e6:.1f}us {tbps:.2f}TB/s", flush=True)
                    except Exception as e:
                        print(f"TUNE B={batch} S={context} fp8={fp8} {blk} failed: "
                              f"{type(e).__name__}: {str(e)[:200]}", flush=True)


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no commit yet)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/paged_attention.json")
    ap.add_argument("--tune", action="store_true")
    args = ap.parse_args(argv)
    key = jax.random.PRNGKey(0)
    if args.tune:
        tune(key)
    result = {"suite": "paged_attention", "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "git": git_sha(), "date": str(datetime.date.today()),
              "command": "python -m bench.kernels " + " ".join(sys.argv[1:]),
              "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "page": PAGE},
              "ceilings": ceilings(), "rows": []}
    for batch in BATCHES:
        for context in CONTEXTS:
            if batch * context > MAX_TOKENS:
                continue
            for fp8 in (False, True):
                save(result, bench_attention(batch, context, fp8, key), args.out)
    for batch in BATCHES:
        for fp8 in (False, True):
            save(result, [bench_write_kv(batch, fp8, key)], args.out)


def save(result: dict, rows: list[dict], path: str) -> None:
    """Append rows and rewrite the file, so a run cut short still leaves its numbers."""
    result["rows"] += rows
    for r in rows:
        print(json.dumps(r), flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
