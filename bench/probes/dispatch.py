"""What the host pays to dispatch one step on the GPU (the engine's `dispatch` phase).

    python -m bench.probes.dispatch [--out bench/results/dispatch.json] [--git SHA]

Two parts, one result file:

  args    host time per call of a jitted function of N small array arguments, dispatched
          back to back (N = 16 .. 1024): the arguments read by the program (`used`) or not
          (`pruned`: jit drops them, so only jax's own flatten and checks remain). The
          unrolled 8B step takes ~390 arguments (10 per layer and a K and a V per layer),
          Qwen2.5-32B's ~840.
  cmdbuf  a 16-layer stand-in step (GEMMs and fusions whose intermediates live in XLA's
          temp allocation; four small outputs shaped like sampling.SampleOutput)
          dispatched 40 times while the previous call's outputs stay alive, as the async
          engine keeps them: outputs `fresh` (new buffers every call, as the engine's step),
          `aliased` (written into donated buffers passed in), `aliased_copy` (aliased, then
          a second small program copies them out for the host). XLA's log
          (TF_CPP_VMODULE=command_buffer_thunk=3, read from a child process) gives for each
          how often the command buffer (CUDA graph) was re-recorded, how many of its
          allocations had moved, and the median re-record time. Off the GPU there are no
          command buffers: the counts are 0.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.probes import write_probe

ARG_COUNTS = (16, 128, 512, 1024)
VARIANTS = ("fresh", "aliased", "aliased_copy")
MARK = "=== dispatch probe variant "


def per_call_ms(fn, args, n: int = 50, reps: int = 5) -> float:
    """Median over `reps` bursts of host ms per call of `n` calls dispatched back to back."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        times.append((time.perf_counter() - t0) / n * 1e3)
        jax.block_until_ready(out)
    return statistics.median(times)


def args_rows(counts=ARG_COUNTS, n: int = 50) -> list[dict]:
    rows = []
    x = jnp.ones((256,))
    for count in counts:
        leaves = [jnp.full((256,), float(i)) for i in range(count)]
        used = jax.jit(lambda ls, x: x + sum(leaf[:1] for leaf in ls)).lower(leaves, x).compile()
        pruned = jax.jit(lambda ls, x: x * 2).lower(leaves, x).compile()
        rows.append({"part": "args", "args": count,
                     "used_ms": round(per_call_ms(used, (leaves, x), n), 4),
                     "pruned_ms": round(per_call_ms(pruned, (leaves, x), n), 4)})
        print(rows[-1], flush=True)
    return rows


def _stand_in(layers: int, width: int):
    ws = [jnp.asarray(np.random.default_rng(i).standard_normal((width, width)) * 0.02,
                      jnp.bfloat16) for i in range(layers)]

    def body(ws, x, step):
        for w in ws:
            x = jax.nn.silu(x @ w) + x * 0.5
        logits = x.astype(jnp.float32) + step.astype(jnp.float32)
        top_lp, top_ids = jax.lax.top_k(logits, 20)
        return (jnp.argmax(logits, -1).astype(jnp.int32), jnp.max(logits, -1),
                top_ids.astype(jnp.int32), top_lp)

    fresh = jax.jit(body)
    # keep_unused: jit drops an argument the program never reads, and with it the donation
    # (the twenty-eighth session's run lacked it: its `aliased` outputs were fresh).
    aliased = jax.jit(lambda ws, x, step, outs: body(ws, x, step), donate_argnums=3,
                      keep_unused=True)
    copy = jax.jit(lambda outs: tuple(o + 0 for o in outs))
    return ws, fresh, aliased, copy


def run_variants(layers: int = 16, width: int = 2048, calls: int = 40) -> dict[str, float]:
    """The child: each variant's calls, a MARK line on stderr before each; host ms per call."""
    ws, fresh, aliased, copy = _stand_in(layers, width)
    x = jnp.ones((8, width), jnp.bfloat16)
    zeros = lambda: (jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.float32),  # noqa: E731
                     jnp.zeros((8, 20), jnp.int32), jnp.zeros((8, 20), jnp.float32))
    jax.block_until_ready((fresh(ws, x, np.uint32(0)), copy(aliased(ws, x, np.uint32(0),
                                                                    zeros()))))  # compiles
    host = {}
    for kind in VARIANTS:
        print(MARK + kind, file=sys.stderr, flush=True)
        outs, held = zeros(), None
        t0 = time.perf_counter()
        for i in range(calls):
            if kind == "fresh":
                held = fresh(ws, x, np.uint32(i))
            else:
                outs = aliased(ws, x, np.uint32(i), outs)
                held = outs if kind == "aliased" else copy(outs)
        host[kind] = round((time.perf_counter() - t0) / calls * 1e3, 4)
        jax.block_until_ready(held)
    return host


def parse_log(text: str) -> dict[str, dict]:
    """XLA's command_buffer_thunk log (VLOG 3) split at the MARK lines: per variant, the
    re-records of each command buffer by (commands, moved allocations), their median us and
    the executions."""
    out, cur = {}, None
    for line in text.splitlines():
        if MARK in line:
            cur = out.setdefault(line.split(MARK, 1)[1].strip(),
                                 {"updates": collections.Counter(), "us": [], "executes": 0})
        elif cur is not None:
            m = re.search(r"num_commands=(\d+); updated_allocs=(\d+)", line)
            if m:
                cur["updates"][f"{m.group(1)} commands, {m.group(2)} moved"] += 1
            m = re.search(r"Updated command buffer in (\d+)", line)
            if m:
                cur["us"].append(int(m.group(1)))
            cur["executes"] += "Execute command buffer" in line
    return {k: {"executes": v["executes"], "re_records": dict(v["updates"]),
                "re_record_us_median": statistics.median(v["us"]) if v["us"] else None}
            for k, v in out.items()}


def cmdbuf_rows(layers: int, width: int, calls: int) -> list[dict]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_thunk=3")
    child = subprocess.run([sys.executable, "-m", "bench.probes.dispatch", "--child",
                            "--layers", str(layers), "--width", str(width),
                            "--calls", str(calls)],
                           env=env, capture_output=True, text=True, timeout=600)
    if child.returncode != 0:
        raise SystemExit(f"the child failed:\n{child.stderr[-3000:]}")
    host = dict(re.findall(r"^host (\S+) ([\d.]+)$", child.stdout, re.M))
    logged = parse_log(child.stderr)
    rows = [{"part": "cmdbuf", "variant": k, "calls": calls, "host_ms_per_call": float(host[k]),
             **logged.get(k, {"executes": 0, "re_records": {}, "re_record_us_median": None})}
            for k in VARIANTS]
    for r in rows:
        print(r, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/dispatch.json")
    ap.add_argument("--git", default=None)
    ap.add_argument("--arg-counts", default=",".join(map(str, ARG_COUNTS)))
    ap.add_argument("--layers", type=int, default=16, help="stand-in step's layers")
    ap.add_argument("--width", type=int, default=2048, help="stand-in step's hidden size")
    ap.add_argument("--calls", type=int, default=40, help="stand-in step's calls per variant")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        for kind, ms in run_variants(args.layers, args.width, args.calls).items():
            print(f"host {kind} {ms}", flush=True)
        return
    rows = args_rows(tuple(int(c) for c in args.arg_counts.split(",")))
    rows += cmdbuf_rows(args.layers, args.width, args.calls)
    write_probe(args.out, "dispatch", args.git, argv, rows)


if __name__ == "__main__":
    main()
