"""`jaxinfer bench profile`: where the time of one decode step goes, kernel by kernel.

For each (B, C): the decode step is warmed up, then N steps are dispatched back to back under
`jax.profiler.trace` (CUPTI on the GPU; a Perfetto trace, no extra package needed). The
device events of those steps are read back and summed:

  busy_ms_per_step    sum of kernel (and memcpy) durations per step
  span_ms_per_step    first kernel start to last kernel end, per step (step_ms_device-like)
  gap_ms_per_step     span - busy: launch gaps, host waits, stream bubbles
  by_category         per step: gemm (cuBLAS / XLA GEMV / Triton GEMM), attention (our
                      Pallas kernels), sampling (sorts, top-k, RNG), copy (memcpy, copy and
                      dynamic-slice/update fusions), other fusions
  top                 the heaviest kernels: name, calls per step, ms per step, HLO op

The numbers are what the profiler saw, with its own overhead (a few us per kernel); read them
as shares. On the CPU there are no device kernels: the host-side XLA ops are listed instead,
so the suite runs end to end (CI) but judges nothing.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import numpy as np

from bench.common import (burst, decode_input, fill_kv, load_runner, new_result, print_table,
                          save)

KEYS = ["batch", "context", "unroll_layers", "unprofiled_ms_per_step", "dispatch_ms_per_step",
        "span_ms_per_step", "busy_ms_per_step",
        "gap_ms_per_step", "kernels_per_step", "gemm_ms", "attention_ms", "sampling_ms",
        "copy_ms", "other_ms"]

_CATEGORIES = (  # first match wins; matched against "kernel name | hlo op"
    ("attention", re.compile(r"paged|attention|ragged|flash", re.I)),
    ("sampling", re.compile(r"sort|cub|top_?k|topk|threefry|random|rng|argmax|cumsum", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cublas|xmma|cutlass|matmul|dot|sm90_|wgmma", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|dynamic[-_]slice|dynamic[-_]update|transpose",
                        re.I)),
)


_FAMILY = re.compile(r"[._]?\d+(?=$|[._])")


def category(label: str) -> str:
    for name, pattern in _CATEGORIES:
        if pattern.search(label):
            return name
    return "other"


def trace_events(fn) -> list[dict]:
    """Complete ('X') events of the profiled region, with their process names."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=_options()):
            fn()
        return read_events(d)


def _options():
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python function events would slow the host side
    return options


def start_trace(d: str) -> None:
    """Start a trace into directory d (stop it with jax.profiler.stop_trace, then read_events):
    for a region that is not one function call, e.g. a window of engine steps."""
    jax.profiler.start_trace(d, create_perfetto_trace=True, profiler_options=_options())


def read_events(d: str) -> list[dict]:
    """The complete ('X') events of the trace written into d, with process/thread names."""
    files = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
    if not files:
        raise RuntimeError("the profiler wrote no perfetto trace")
    with gzip.open(files[0]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        e = dict(e, process=procs.get(e["pid"], ""),
                 thread=threads.get((e["pid"], e.get("tid")), ""))
        out.append(e)
    return out


def device_events(events: list[dict]) -> list[dict]:
    """GPU kernels/memcpys (stream lanes of a /device:GPU process); on the CPU, the XLA ops
    of the executing thread(s) instead."""
    gpu = [e for e in events if "/device:GPU" in e["process"] and "Stream" in e["thread"]]
    if gpu:
        return gpu
    return [e for e in events if "XLA" in e["thread"] and not e["name"].startswith("$")
            and not e["name"].startswith(("ThunkExecutor", "while"))]


def busy_seconds(events: list[dict], calls: int) -> float:
    """Device time per call: the summed durations (us) of every device event (kernels and
    copies alike, so nothing of an op's own work is left out) over `calls` calls."""
    if calls < 1 or not events:
        raise ValueError(f"busy_seconds: {len(events)} events over {calls} calls")
    return sum(e["dur"] for e in events) * 1e-6 / calls


def device_seconds(run, calls: int) -> float | None:
    """Device-side time per call of `run()` (which dispatches `calls` calls and returns their
    outputs): run once to warm up, then once under the profiler; busy_seconds of its device
    events. The op suites' `us_device`: unlike a host clock around back-to-back dispatches,
    it leaves out the device's idle time between launches. None off the GPU (the CPU's
    "device events" are host-side XLA ops)."""
    if jax.default_backend() != "gpu":
        return None
    jax.block_until_ready(run())
    return busy_seconds(device_events(trace_events(lambda: jax.block_until_ready(run()))),
                        calls)


def summarize(events: list[dict], steps: int, top: int = 25) -> dict:
    if not events:
        return {"kernels_per_step": 0}
    events = sorted(events, key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in events) / 1e3 / steps
    span = (max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]) / 1e3 / steps
    by_cat = collections.Counter()
    by_name = collections.defaultdict(lambda: [0, 0.0, ""])
    for e in events:
        args = e.get("args", {})
        op = str(args.get("hlo_op", args.get("long_name", "")))
        by_cat[category(f"{e['name']} | {op}")] += e["dur"]
        rec = by_name[e["name"]]
        rec[0] += 1
        rec[1] += e["dur"]
        rec[2] = rec[2] or op
    heavy = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    # Kernel families (trailing numbers dropped), and the idle time before each kernel
    # charged to its family: which launches the device waits for.
    families = collections.defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = None
    for e in events:
        fam = families[_FAMILY.sub("", e["name"])[:80]]
        fam[0] += 1
        fam[1] += e["dur"]
        if prev_end is not None:
            fam[2] += max(0.0, e["ts"] - prev_end)
        prev_end = max(prev_end or 0.0, e["ts"] + e["dur"])
    return {
        "kernels_per_step": round(len(events) / steps, 1),
        "busy_ms_per_step": round(busy, 4), "span_ms_per_step": round(span, 4),
        "gap_ms_per_step": round(span - busy, 4),
        **{f"{c}_ms": round(by_cat.get(c, 0) / 1e3 / steps, 4)
           for c in ("gemm", "attention", "sampling", "copy", "other")},
        "top": [{"name": n[:160], "calls_per_step": round(c / steps, 2),
                 "ms_per_step": round(t / 1e3 / steps, 4), "hlo_op": op[:120],
                 "category": category(f"{n} | {op}")} for n, (c, t, op) in heavy],
        "families": [{"family": f, "calls_per_step": round(c / steps, 2),
                      "ms_per_step": round(t / 1e3 / steps, 4),
                      "gap_before_ms_per_step": round(g / 1e3 / steps, 4)}
                     for f, (c, t, g) in sorted(families.items(),
                                                key=lambda kv: -kv[1][1] - kv[1][2])[:top]],
    }


def run(args) -> int:
    batches, contexts = args.batch_sizes, args.contexts
    runner, cfg, _ = load_runner(args, max_num_seqs=max(batches), max_len=max(contexts) + 1,
                                 pairs=[(b, c) for b in batches for c in contexts],
                                 kv_budget_gb=args.kv_budget_gb)
    runner.kv = fill_kv(runner.kv)
    result = new_result(args, model=args.model, steps=args.reps)
    rng = np.random.default_rng(0)
    for b in batches:
        for c in contexts:
            inp = runner.prepare(decode_input(cfg, runner.engine, b, c, rng))
            for _ in range(3):
                runner.step(inp)

            burst(runner, inp, args.reps)
            # Without the profiler: host dispatch time vs the whole burst.
            dispatch_s, total_s = burst(runner, inp, args.reps)
            events = trace_events(lambda: burst(runner, inp, args.reps))
            summary = summarize(device_events(events), args.reps)
            host = collections.defaultdict(float)
            for e in events:
                if "/host:" in e["process"]:
                    host[f"{e['thread'].split('/')[0]}: {e['name']}"[:100]] += e["dur"]
            lanes = collections.Counter(f"{e['process']} | {e['thread']}" for e in events)
            row = {"model": args.model, "batch": b, "context": c,
                   "unroll_layers": runner.engine.unroll_layers,
                   "dispatch_ms_per_step": round(dispatch_s / args.reps * 1e3, 4),
                   "unprofiled_ms_per_step": round(total_s / args.reps * 1e3, 4), **summary,
                   "lanes": dict(lanes.most_common(8)),
                   "host_top_ms_per_step": {k: round(v / 1e3 / args.reps, 4) for k, v in
                                            sorted(host.items(), key=lambda kv: -kv[1])[:20]}}
            save(result, args.out, [row])
            for k in row.get("families", [])[:16]:
                print(f"  {k['ms_per_step']:8.4f} ms +gap {k['gap_before_ms_per_step']:7.4f}"
                      f"  x{k['calls_per_step']:<6} {k['family'][:70]}")
    print_table(result["rows"], KEYS)
    return 0
