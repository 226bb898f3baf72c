"""`jaxinfer bench fusion`: the same decode step fused, unfused, and without command buffers,
measured in one run — the before/after table of kernel fusion.

  fused              the runner's one jitted step (XLA fuses; command buffers at XLA's
                     default for this jax), timed as serving runs it (step_ms: sync on the
                     sampled tokens each step) and pipelined (step_ms_device)
  unfused            the same step function run op by op under `jax.disable_jit()`: every
                     primitive is dispatched as its own executable (the "eager" baseline;
                     lax.scan over layers becomes a Python loop)
  fused_cmdbuf_off   the fused step in a child process started with
                     XLA_FLAGS=--xla_gpu_enable_command_buffer= (no CUDA graphs)

Kernels per step: from the compiled HLO (bench/hlo.py) for the fused variants; for the
unfused one, the primitives dispatched (scan bodies counted per layer, the branch of each
cond that runs counted once, while-loop bodies once) — each is at least one kernel launch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from bench import hlo
from bench.common import (decode_input, engine_argv, fill_kv, load_runner, new_result,
                          pipelined_step_s, print_table, save, timed)

KEYS = ["variant", "batch", "context", "step_ms", "step_ms_device", "kernels_per_step",
        "kernels_per_layer", "command_buffers"]
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="


def fused_row(runner, cfg, inp, reps: int) -> dict:
    a = hlo.analyze(runner.lower(inp).compile().as_text(), cfg.num_layers)
    return {"step_ms": round(timed(lambda: runner.step(inp), reps) * 1e3, 4),
            "step_ms_device": round(pipelined_step_s(runner, inp, reps) * 1e3, 4),
            "kernels_per_step": a["kernels_per_step"], "kernels_per_layer": a["kernels_per_layer"],
            "command_buffers": a["command_buffers_per_step"],
            "command_buffer_coverage": a["command_buffer_coverage"]}


def count_primitives(jaxpr, layers: list) -> int:
    """Primitive applications one eager run dispatches (see the module docstring)."""
    n = 0
    for eqn in jaxpr.eqns:
        subs = [v for v in eqn.params.values() if hasattr(v, "jaxpr") or hasattr(v, "eqns")]
        branches = eqn.params.get("branches")
        if eqn.primitive.name == "scan":
            inner = count_primitives(eqn.params["jaxpr"].jaxpr, layers)
            layers.append((eqn.params["length"], inner))
            n += eqn.params["length"] * inner
        elif branches:
            n += 1 + min(count_primitives(b.jaxpr, layers) for b in branches)
        elif subs and eqn.primitive.name != "pallas_call":
            n += sum(count_primitives(getattr(s, "jaxpr", s), layers) for s in subs)
        else:
            n += 1
    return n


def unfused_row(runner, cfg, inp, reps: int) -> dict:
    """The runner's own step run op by op (jax.disable_jit), and its primitives counted."""
    layers: list[tuple[int, int]] = []  # (length, primitives per iteration) of each scan
    per_step = count_primitives(runner.trace(inp).jaxpr.jaxpr, layers)

    def once():
        with jax.disable_jit():
            runner.step(inp)    # blocks on the sampled tokens
    once()  # compiles every primitive once
    sec = timed(once, max(2, reps // 3), min_s=0.0)
    return {"step_ms": round(sec * 1e3, 4), "kernels_per_step": per_step,
            "kernels_per_layer": max((n for length, n in layers if length == cfg.num_layers),
                                     default=None),
            "kernels_note": "primitives dispatched (>= kernel launches)"}


def cmdbuf_off_rows(args) -> list[dict]:
    """The fused rows again, in a child process with command buffers disabled."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + CMDBUF_OFF))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, "-m", "bench.cli", "fusion", "--child", "cmdbuf_off",
               "--out", str(out), "--reps", str(args.reps), "--kv-budget-gb",
               str(args.kv_budget_gb), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
               "--contexts", ",".join(map(str, args.contexts)), *engine_argv(args)]
        subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        return json.loads(out.read_text())["rows"]


def run(args) -> int:
    pairs = [(b, c) for b in args.batch_sizes for c in args.contexts]
    runner, cfg, _ = load_runner(args, max_num_seqs=max(args.batch_sizes),
                                        max_len=max(args.contexts) + 1, pairs=pairs,
                                        kv_budget_gb=args.kv_budget_gb)
    runner.kv = fill_kv(runner.kv)
    result = new_result(args, model=args.model,
                        xla_flags=os.environ.get("XLA_FLAGS", ""))
    rng = np.random.default_rng(0)
    for b, c in pairs:
        inp = runner.prepare(decode_input(cfg, runner.engine, b, c, rng))
        case = {"batch": b, "context": c}
        variant = "fused_cmdbuf_off" if args.child else "fused"
        save(result, args.out, [{"variant": variant, **case,
                                 **fused_row(runner, cfg, inp, args.reps)}])
        if not args.child and not args.no_unfused:
            save(result, args.out, [{"variant": "unfused", **case,
                                     **unfused_row(runner, cfg, inp, args.reps)}])
    if args.child:
        return 0
    if not args.no_cmdbuf_child:
        try:
            save(result, args.out, cmdbuf_off_rows(args))
        except subprocess.CalledProcessError as e:  # keep the in-process rows regardless
            result["cmdbuf_off_error"] = f"child process exited with {e.returncode}"
    summarize(result)
    save(result, args.out)
    print_table(result["rows"], KEYS)
    print({k: v for k, v in result.items() if k.endswith("batch1")})
    return 0


def summarize(result: dict) -> None:
    """Top-level ratios at batch 1 (the smallest context measured)."""
    def step(variant):
        rows = sorted((r for r in result["rows"] if r["variant"] == variant
                       and r["batch"] == 1), key=lambda r: r["context"])
        return rows[0]["step_ms"] if rows else None
    fused, unfused, off = step("fused"), step("unfused"), step("fused_cmdbuf_off")
    result["fused_over_unfused_batch1"] = round(unfused / fused, 3) if fused and unfused \
        else None
    result["cmdbuf_on_over_off_batch1"] = round(off / fused, 3) if fused and off else None
