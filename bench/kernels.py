"""Paged decode attention on one GPU: jaxinfer's Pallas kernel vs the bundled JAX kernel
(jax.experimental.pallas.ops.gpu.paged_attention, [K, P, S, D] pages) vs the XLA reference,
bf16 and FP8 KV, plus the cost of writing the step's new K/V (jaxinfer.kv_cache.write_kv).

    python -m bench.kernels --out bench/results/paged_attention.json [--tune] [--git SHA]

FP8 KV rows carry `kv_scales`: `static` (one scale per kv head, the engine's default; the
`jaxinfer` row) or `token` (one per token and kv head: every impl, and
`jaxinfer_f16widen`, the tuned blocks with e4m3 tiles widened to f16, the earlier path).
`jaxinfer` is the tuned blocks, FP8 read as u16 byte pairs; every FP8 jaxinfer row carries
`vs_bf16_kv` (jaxinfer on bf16 KV of the same shape, same run / this). The check of the FP8
choice alone, ~2-3 minutes on an H200:

    python -m bench.kernels --batches 1,64 --contexts 2048,8192,32768 \
        --impls jaxinfer,jaxinfer_f16widen --no-write-kv --out /tmp/paged_attention_fp8.json

Method (shared/BENCH.md): one process; ceilings (bench/ceilings.py) measured in the same
run; random data; each timed call runs the op over R page tables drawn from one large cache,
R chosen so the bytes touched per call exceed 4x the 60 MB L2; calls are dispatched back to
back and the median over repeats of (elapsed / ops) is reported as `us` (host clock). On the
GPU each row also has `us_device`: the same calls run under the profiler, the durations of
all their device kernels and copies summed per op (BENCH.md's device-side timing). The host
clock also counts the device's idle time between launches, which a kernel inside the model's
step (replayed from a command buffer) mostly does not pay; the targets are read on
`us_device`, and both stay in the file. Bytes counted: K/V (+ per-token FP8 scales) of every
sequence's live tokens, q and the output. `--tune` only times candidate
block sizes (for FP8 also the compute dtypes; page-table prefetch on/off) on the target shapes
and prints them (the winners go into pallas_kernels/tuning.py by hand). `--mixed` adds one
mixed step's attention (bench/mixed_attention.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bench import ceilings
from bench.common import new_result, parse_ints, save
from bench.profile import device_seconds
from jaxinfer.kv_cache import FP8_DTYPE, KVCache, write_kv
from pallas_kernels import tuning
from pallas_kernels.paged_attention import (paged_attention, paged_attention_blocks,
                                            paged_attention_reference)

HQ, HKV, D, PAGE = 32, 8, 128, 16
BATCHES, CONTEXTS = (1, 8, 64, 256), (512, 2048, 8192, 32768)
MAX_TOKENS = 1 << 21       # B*S cap: 8.6 GB of bf16 KV per page-table set
MAX_REF_TOKENS = 1 << 19   # the XLA reference materializes f32 K/V: keep it smaller
TOUCH_BYTES = 256 << 20
IMPLS = ("jaxinfer", "jaxinfer_f16widen", "bundled", "xla_reference")


def timed(fn, args, reps: int = 15, min_s: float = 2e-3) -> float:
    """Seconds per call: median over reps of back-to-back dispatches lasting >= min_s (one
    block per batch of calls, unlike bench.common.timed's per call: a kernel's time without
    the host round trip)."""
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


def make_case(batch: int, context: int, fp8: bool, key, page: int = PAGE,
              static: bool = False):
    """One [1, K, P, S, D] cache (S = `page` tokens per page) and R disjoint random page
    tables [R, B, context / page]; FP8 scales per token ([1, K, P, S]) or, `static`, per kv
    head ([1, K])."""
    pps = context // page
    per_set = batch * context * HKV * D * (1 if fp8 else 2) * 2
    rot = max(2, min(64, math.ceil(TOUCH_BYTES / per_set)))
    pages = 1 + rot * batch * pps
    ks = jax.random.split(key, 6)
    shape = (1, HKV, pages, page, D)
    dt = FP8_DTYPE if fp8 else jnp.bfloat16
    k = jax.random.normal(ks[0], shape, jnp.bfloat16).astype(dt)
    v = jax.random.normal(ks[1], shape, jnp.bfloat16).astype(dt)
    scale_shape = shape[:2] if static else shape[:-1]
    scales = [jax.random.uniform(s, scale_shape, jnp.float32, 0.5, 1.5) / 16 for s in ks[2:4]]
    tables = (1 + jax.random.permutation(ks[4], pages - 1)).reshape(rot, batch, pps)
    q = jax.random.normal(ks[5], (batch, HQ, D), jnp.bfloat16)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k, v, (scales if fp8 else [None, None]), tables.astype(jnp.int32), lens


def kv_bytes(tokens: int, fp8: bool, static: bool = False) -> int:
    """K and V bytes (with FP8's per-token f32 scales unless `static`) of `tokens` context
    tokens over the kv heads."""
    return tokens * HKV * (D * (1 if fp8 else 2) + (4 if fp8 and not static else 0)) * 2


def bytes_moved(batch: int, context: int, fp8: bool, static: bool = False) -> int:
    return kv_bytes(batch * context, fp8, static) + 2 * batch * HQ * D * 2


def timing(wall: float, device: float | None, nbytes: int) -> dict:
    """A row's times: host-clock us, device us and TB/s of `nbytes` (None off the GPU)."""
    return {"us": round(wall * 1e6, 1),
            "us_device": round(device * 1e6, 1) if device else None,
            "TBps_device": round(nbytes / device / 1e12, 3) if device else None}


def decode_with(blocks: tuning.DecodeBlocks, layer: int = 0, **options):
    """f(q, k, v, ks, vs, table, lens): paged_attention_blocks on the cache's `layer` (0: the
    [1, K, P, S, D] case), with `blocks` and paged_attention_blocks' other options
    (interpret, ...)."""
    return lambda q, k, v, ks, vs, t, n: paged_attention_blocks(
        q, k, v, layer, n, t, ks, vs, sm_scale=D ** -0.5, blocks=blocks, **options)


def tuned_blocks(batch: int, context: int, fp8: bool, page: int = PAGE) -> tuning.DecodeBlocks:
    return tuning.decode_blocks(batch, HKV, context, page, 1 if fp8 else 2, D)


def widened_f16(blocks: tuning.DecodeBlocks) -> tuning.DecodeBlocks:
    return dataclasses.replace(blocks, fp8_compute="float16")


def impls(fp8: bool, blocks: tuning.DecodeBlocks, tuned: bool = True):
    """name -> f(q, k, v, ks, vs, table, lens) on the [1, K, P, S, D] cache, layer 0.
    jaxinfer is the public entry (tuned blocks) unless `tuned` is False (a --tune
    candidate); jaxinfer_f16widen is `blocks` with e4m3 tiles widened to f16."""
    scale = D ** -0.5

    def ours(blk):
        if blk is None:
            return lambda q, k, v, ks, vs, t, n: paged_attention(
                q, k, v, 0, n, t, ks, vs, sm_scale=scale)
        return decode_with(blk)

    def bundled(q, k, v, ks, vs, t, n):
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pa
        sq = (lambda x: None if x is None else x[0])
        return pa(q * scale, k[0], v[0], t, n, sq(ks), sq(vs))  # bundled has no sm_scale

    def ref(q, k, v, ks, vs, t, n):
        return paged_attention_reference(q, k, v, 0, n, t, ks, vs, sm_scale=scale)
    out = {"jaxinfer": ours(None if tuned else blocks)}
    if fp8:
        out["jaxinfer_f16widen"] = ours(widened_f16(blocks))
    return {**out, "bundled": bundled, "xla_reference": ref}


def rotated(fn):
    """One jitted call = fn over every page table of the rotation."""
    return jax.jit(lambda q, k, v, ks, vs, tables, n: [fn(q, k, v, ks, vs, tables[r], n)
                                                        for r in range(tables.shape[0])])


def time_impl(fn, case, reps: int = 3) -> tuple[float, float | None]:
    """(host-clock seconds per call, device seconds per call or None off the GPU) of `fn`
    on `case`, one compiled program for both. Device: the rotated call run `reps` times
    back to back under the profiler (bench.profile.device_seconds). Unlike the host clock it
    leaves out the device's idle time between kernels (launch gaps inside each dispatched
    executable and between them: on the H200, 10 us per call at B=1 S=512 and 40 us at
    B=64 S=2048, bf16; bench/README.md, thirteenth session), which the model's step, kernels
    replayed from a command buffer, mostly does not have."""
    q, k, v, (ks, vs), tables, lens = case
    call, args = rotated(fn), (q, k, v, ks, vs, tables, lens)
    wall = timed(call, args) / tables.shape[0]
    device = device_seconds(lambda: [call(*args) for _ in range(reps)], reps * tables.shape[0])
    return wall, device


STATIC_IMPLS = ("jaxinfer",)   # timed on static FP8 scales too (the engine's default form)


def bench_attention(batch, context, fp8, key, names, bf16_kv=None,
                    static: bool = False) -> list[dict]:
    """Rows for the impls in `names`, each timed by the host clock (`us`, `TBps`) and, on the
    GPU, by the profiler's device time (`us_device`, `TBps_device`); ratios of either kind
    (vs_bundled, vs_bundled_device). FP8 jaxinfer rows get vs_bf16_kv(_device) from bf16_kv,
    the bf16-KV jaxinfer row of the same shape (this run). FP8 rows say their scales'
    form (`kv_scales`: token, or static: only STATIC_IMPLS run)."""
    case = make_case(batch, context, fp8, key, static=static)
    nbytes = bytes_moved(batch, context, fp8, static)
    blocks = tuned_blocks(batch, context, fp8)
    rows, times = [], {}
    base = {"kv_dtype": "fp8" if fp8 else "bf16", "batch": batch, "context": context}
    if fp8:
        base["kv_scales"] = "static" if static else "token"
    for name, fn in impls(fp8, blocks).items():
        if (name not in names or (static and name not in STATIC_IMPLS)
                or (name == "xla_reference" and batch * context > MAX_REF_TOKENS)):
            continue
        try:
            times[name] = dict(zip(("", "_device"), time_impl(fn, case)))
        except Exception as e:  # a failing baseline must not sink the run: record it
            rows.append({"impl": name, **base, "error": f"{type(e).__name__}: {e}"[:300]})
    for name, secs in times.items():
        row = {"impl": name, **base}
        for kind, sec in secs.items():
            if sec is None:
                continue
            row[f"us{kind}"] = round(sec * 1e6, 2)
            row[f"TBps{kind}"] = round(nbytes / sec / 1e12, 3)
            other = times.get("bundled", {}).get(kind)
            if other:
                row[f"vs_bundled{kind}"] = round(other / sec, 3)
            if fp8 and name.startswith("jaxinfer") and bf16_kv and f"us{kind}" in bf16_kv:
                row[f"vs_bf16_kv{kind}"] = round(bf16_kv[f"us{kind}"] * 1e-6 / sec, 3)
        if name.startswith("jaxinfer"):
            row["blocks"] = str(blocks if name == "jaxinfer" else widened_f16(blocks))
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


TUNE_SHAPES = ((64, 2048), (1, 32768), (256, 2048))
TUNE_CANDIDATES = ((32, 4, 4), (64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 2))


def tune(key, shapes=TUNE_SHAPES, kv=(False, True), tiles=TUNE_CANDIDATES,
         split_choices=None, fp8_computes=tuning.FP8_COMPUTE, prefetch=(False,),
         repeat: int = 1) -> None:
    """Time candidate block sizes (tiles: (block_tokens, warps, stages); FP8: each of
    fp8_computes; each page-table prefetch choice, timed back to back) on the target shapes,
    the whole sweep `repeat` times; print, don't write. Splits: split_choices, or the tuned
    rule's (and twice it at B=1). Candidates too big for shared memory print their error."""
    for _ in range(repeat):
        _tune_once(key, shapes, kv, tiles, split_choices, fp8_computes, prefetch)


def _tune_once(key, shapes, kv, tiles, split_choices, fp8_computes, prefetch) -> None:
    """kv: the KV forms to time: False (bf16), True (FP8, per-token scales), "static" (FP8,
    static scales)."""
    cands = tiles
    for batch, context in shapes:
        for form in kv:
            fp8, static = bool(form), form == "static"
            case = make_case(batch, context, fp8, key, static=static)
            base = tuned_blocks(batch, context, fp8)
            splits = sorted(split_choices or {base.num_splits, 2 * base.num_splits
                                              if batch == 1 else base.num_splits})
            computes = fp8_computes if fp8 else ("bfloat16",)
            for (tok, warps, stages), n, comp, pre in itertools.product(cands, splits,
                                                                         computes, prefetch):
                blk = tuning.DecodeBlocks(tok, n, warps, stages, comp, pre)
                label = f"TUNE B={batch} S={context} fp8={fp8}{' static' * static} {blk}"
                try:
                    fn = impls(fp8, blk, tuned=False)["jaxinfer"]
                    sec, dev = time_impl(fn, case)
                    nbytes = bytes_moved(batch, context, fp8, static)
                    busy = "" if dev is None else (f" device {dev * 1e6:.1f}us "
                                                   f"{nbytes / dev / 1e12:.2f}TB/s")
                    print(f"{label} {sec * 1e6:.1f}us {nbytes / sec / 1e12:.2f}TB/s{busy}",
                          flush=True)
                except Exception as e:
                    print(f"{label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def parse_flags(text: str) -> list[int]:
    """'0,1' -> [0, 1]: a comma-separated list of 0/1 choices."""
    values = text.split(",")
    if not set(values) <= {"0", "1"}:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of 0 and 1, got "
                                          f"{text!r}")
    return [int(x) for x in values]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/paged_attention.json")
    ap.add_argument("--git", default=None, help="git sha to record (default: rev-parse HEAD)")
    ap.add_argument("--tune", action="store_true",
                    help="only print the block-size sweep (--tune-*); write no file")
    ap.add_argument("--tune-shapes", type=lambda t: [tuple(map(int, x.split("x")))
                                                     for x in t.split(",")],
                    default=list(TUNE_SHAPES), help="BxS,... the --tune sweep times "
                                                    "(default 64x2048,1x32768,256x2048)")
    ap.add_argument("--tune-kv", choices=("both", "bf16", "fp8", "fp8-static"), default="both",
                    help="KV forms the --tune sweep times (both: bf16 and FP8 with per-token "
                         "scales; fp8-static: FP8 with static scales)")
    ap.add_argument("--tune-tiles", type=lambda t: [tuple(map(int, x.split("x")))
                                                    for x in t.split(",")],
                    default=list(TUNE_CANDIDATES),
                    help="block_tokens x warps x stages,... (default: TUNE_CANDIDATES)")
    ap.add_argument("--tune-splits", type=parse_ints, default=None,
                    help="split counts to time (default: the tuned rule's)")
    ap.add_argument("--tune-fp8-compute", type=lambda t: t.split(","),
                    default=list(tuning.FP8_COMPUTE), help="FP8 widening dtypes to time")
    ap.add_argument("--tune-prefetch", type=parse_flags, default=[0],
                    help="page-table prefetch choices to time, 0 and/or 1 (default 0)")
    ap.add_argument("--tune-repeat", type=int, default=1, help="run the --tune sweep N times")
    ap.add_argument("--batches", type=parse_ints, default=list(BATCHES))
    ap.add_argument("--contexts", type=parse_ints, default=list(CONTEXTS))
    ap.add_argument("--impls", type=lambda t: t.split(","), default=list(IMPLS),
                    help=f"comma-separated subset of {','.join(IMPLS)}")
    ap.add_argument("--no-write-kv", action="store_true", help="skip the write_kv rows")
    ap.add_argument("--mixed", action="store_true",
                    help="also time one mixed step's attention (255 decode rows + a "
                         "1793-token prefill chunk): the public entry (decode rows split "
                         "off) vs the ragged kernel over every row (rows ragged_*, split_*)")
    args = ap.parse_args(argv)
    if set(args.impls) - set(IMPLS):
        ap.error(f"unknown impls {sorted(set(args.impls) - set(IMPLS))}; known: {IMPLS}")
    key = jax.random.PRNGKey(0)
    if args.tune:
        tune(key, args.tune_shapes, {"both": (False, True), "bf16": (False,), "fp8": (True,),
                                     "fp8-static": ("static",)}[args.tune_kv], args.tune_tiles,
             args.tune_splits, args.tune_fp8_compute,
             tuple(bool(x) for x in args.tune_prefetch), args.tune_repeat)
        return        # a sweep only prints (it once went on to the whole default grid)
    result = new_result("paged_attention", args.git,
                        command="python -m bench.kernels " + " ".join(sys.argv[1:]),
                        shape={"Hq": HQ, "Hkv": HKV, "D": D, "page": PAGE},
                        ceilings=ceilings.measure())
    if args.mixed:
        from bench.mixed_attention import bench_mixed   # it imports this module's helpers
        save(result, args.out, bench_mixed(key))
    for batch in args.batches:
        for context in args.contexts:
            if batch * context > MAX_TOKENS:
                continue
            rows = bench_attention(batch, context, False, key, args.impls)
            bf16 = next((r for r in rows if r["impl"] == "jaxinfer" and "us" in r), None)
            for static in (True, False):
                rows += bench_attention(batch, context, True, key, args.impls, bf16, static)
            save(result, args.out, rows)
    for batch in [] if args.no_write_kv else args.batches:
        for fp8 in (False, True):
            save(result, args.out, [bench_write_kv(batch, fp8, key)])


if __name__ == "__main__":
    main()
