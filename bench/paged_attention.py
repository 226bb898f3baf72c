"""`jaxinfer bench paged_attention` (alias `kernels`): paged decode attention on one device.

jaxinfer's Pallas kernel (the public `paged_attention` entry) vs JAX's bundled kernel
(jax.experimental.pallas.ops.gpu.paged_attention, [K, P, S, D] pages) vs the XLA reference,
bf16 and FP8 KV, at Hq 32, Hkv 8, D 128, page 16 (Llama-3-8B's attention). FP8 rows carry
`kv_scales`: `static` (one scale per kv head, the engine's default: jaxinfer only) or `token`
(per token and kv head: every impl).

Method: one process, ceilings measured in the same run, random data; each
timed call runs the op over R page tables drawn from one large cache, R chosen so the bytes
touched per call exceed 4x the 60 MB L2; `us` is the host clock over back-to-back calls
(median), `us_device` the same calls' kernel time under the profiler (GPU only), which leaves
out the launch gaps a kernel replayed inside the model's step mostly does not pay. Bytes:
K/V (+ per-token FP8 scales) of every sequence's live tokens, q and the output. Off the GPU
the Pallas kernels run in interpret mode: the CPU run checks the plumbing, not speed.
"""
from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp

from bench import ceilings
from bench.common import new_result, save
from bench.profile import device_seconds
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

HQ, HKV, D, PAGE = 32, 8, 128, 16
FP8 = jnp.float8_e4m3fn
MAX_TOKENS = 1 << 21       # B*S cap: 8.6 GB of bf16 KV per page-table set
MAX_REF_TOKENS = 1 << 19   # the XLA reference materializes f32 K/V: keep it smaller
TOUCH_BYTES = 256 << 20    # bytes one timed call touches at least (GPU)
IMPLS = ("jaxinfer", "bundled", "xla_reference")


def timed(fn, args, reps: int = 15, min_s: float = 2e-3) -> float:
    """Seconds per call: median over reps of back-to-back dispatches lasting >= min_s, one
    block per batch of calls (a kernel's time without a host round trip per call)."""
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


def make_case(batch: int, context: int, fp8: bool, key, static: bool = False):
    """One [1, K, P, S, D] cache and R disjoint random page tables [R, B, context / S]; FP8
    scales per token ([1, K, P, S]) or, `static`, per kv head ([1, K])."""
    pps = context // PAGE
    per_set = batch * context * HKV * D * (1 if fp8 else 2) * 2
    touch = TOUCH_BYTES if jax.default_backend() == "gpu" else 0
    rot = max(2, min(64, math.ceil(touch / per_set)))
    pages = 1 + rot * batch * pps
    ks = jax.random.split(key, 6)
    shape = (1, HKV, pages, PAGE, D)
    dt = FP8 if fp8 else jnp.bfloat16
    k = jax.random.normal(ks[0], shape, jnp.bfloat16).astype(dt)
    v = jax.random.normal(ks[1], shape, jnp.bfloat16).astype(dt)
    scale_shape = shape[:2] if static else shape[:-1]
    scales = [jax.random.uniform(s, scale_shape, jnp.float32, 0.5, 1.5) / 16 for s in ks[2:4]]
    tables = (1 + jax.random.permutation(ks[4], pages - 1)).reshape(rot, batch, pps)
    q = jax.random.normal(ks[5], (batch, HQ, D), jnp.bfloat16)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k, v, (scales if fp8 else [None, None]), tables.astype(jnp.int32), lens


def bytes_moved(batch: int, context: int, fp8: bool, static: bool = False) -> int:
    """K and V (with FP8's per-token f32 scales unless `static`) of every live token, q and
    the output."""
    per_token = HKV * (D * (1 if fp8 else 2) + (4 if fp8 and not static else 0)) * 2
    return batch * context * per_token + 2 * batch * HQ * D * 2


def impls():
    """name -> f(q, k, v, ks, vs, table, lens) on the [1, K, P, S, D] cache, layer 0."""
    scale, interpret = D ** -0.5, jax.default_backend() != "gpu"

    def ours(q, k, v, ks, vs, t, n):
        return paged_attention(q, k, v, 0, n, t, ks, vs, sm_scale=scale, interpret=interpret)

    def bundled(q, k, v, ks, vs, t, n):
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pa
        first = (lambda x: None if x is None else x[0])
        return pa(q * scale, k[0], v[0], t, n, first(ks), first(vs),  # no sm_scale argument
                  interpret=interpret)

    def ref(q, k, v, ks, vs, t, n):
        return paged_attention_reference(q, k, v, 0, n, t, ks, vs, sm_scale=scale)
    return {"jaxinfer": ours, "bundled": bundled, "xla_reference": ref}


def time_impl(fn, case, reps: int = 3) -> tuple[float, float | None]:
    """(host-clock seconds per call, device seconds per call or None off the GPU) of `fn`
    on `case`: one jitted program applies it to every page table of the rotation."""
    q, k, v, (ks, vs), tables, lens = case
    call = jax.jit(lambda q, k, v, ks, vs, tables, n: [fn(q, k, v, ks, vs, tables[r], n)
                                                        for r in range(tables.shape[0])])
    args = (q, k, v, ks, vs, tables, lens)
    wall = timed(call, args) / tables.shape[0]
    device = device_seconds(lambda: [call(*args) for _ in range(reps)], reps * tables.shape[0])
    return wall, device


def bench_attention(batch, context, fp8, key, names, bf16_kv=None,
                    static: bool = False) -> list[dict]:
    """Rows for the impls in `names` (static FP8 scales: jaxinfer only): host clock (`us`,
    `TBps`) and device time (`*_device`), ratios to the bundled kernel (`vs_bundled*`) and,
    FP8 jaxinfer rows, to bf16_kv, the bf16 jaxinfer row of the same shape
    (`vs_bf16_kv*`)."""
    case = make_case(batch, context, fp8, key, static=static)
    nbytes = bytes_moved(batch, context, fp8, static)
    rows, times = [], {}
    base = {"kv_dtype": "fp8" if fp8 else "bf16", "batch": batch, "context": context}
    if fp8:
        base["kv_scales"] = "static" if static else "token"
    for name, fn in impls().items():
        if (name not in names or (static and name != "jaxinfer")
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
            if fp8 and name == "jaxinfer" and bf16_kv and f"us{kind}" in bf16_kv:
                row[f"vs_bf16_kv{kind}"] = round(bf16_kv[f"us{kind}"] * 1e-6 / sec, 3)
        rows.append(row)
    return rows


def run(args) -> int:
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"unknown --impls {sorted(unknown)}; known: {', '.join(IMPLS)}")
    key = jax.random.PRNGKey(0)
    result = new_result(args, shape={"Hq": HQ, "Hkv": HKV, "D": D, "page": PAGE},
                        ceilings=ceilings.measure())
    for batch in args.batch_sizes:
        for context in args.contexts:
            if batch * context > MAX_TOKENS or context % PAGE:
                continue
            rows = bench_attention(batch, context, False, key, args.impls)
            bf16 = next((r for r in rows if r["impl"] == "jaxinfer" and "us" in r), None)
            for static in (True, False):
                rows += bench_attention(batch, context, True, key, args.impls, bf16, static)
            save(result, args.out, rows)
    return 0
