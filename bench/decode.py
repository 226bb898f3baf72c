"""`jaxinfer bench decode`: the roofline of the decode step.

For every batch B and context C: B rows, each decoding its token C at position C-1 over C-1
cached tokens, run through `ModelRunner` (the serving step: forward + logits + sampling, KV
donated) with a scheduler-free StepInput. The cache is filled with pseudo-random values
first (never zeros). Two times per case:
  step_ms         back-to-back `runner.step` calls, each syncing on its sampled tokens
                  (what serving sees); median per call
  step_ms_device  steps dispatched back to back, no host round trip: a burst of 16 less a
                  burst of 8, over 8 (bench.common.pipelined_step_s; rows before the
                  eleventh session: a burst of 8 over 8, which counts its start and end)
  dispatch_ms     host time to enqueue one step (of such a burst): if it nears step_ms_device
                  the host, not the GPU, sets the pace
  gpu_clocks      the SM clock and board power through the case (bench/gpu_clocks.py; None
                  off the GPU): at the H200's power cap the clock drops, and kernels slow with it
Bytes that must move per step: every weight read once (embeddings: only the B looked-up rows;
the LM head whole) + the KV of B x C tokens read + the new tokens' KV written.
FLOPs: 2 x matmul params x B + attention (4 x L x H x D x C x B).
MBU = (bytes / read_TBps) / step time; roofline_frac = max(byte floor, FLOP floor) / step
time, against ceilings measured in the same run. The run's XLA read probe under-measures the
H200's HBM (3.5-3.65 TB/s, where the paged-attention kernel reads 4.5 by its device time:
bench/README.md, thirteenth session), so mbu_device can pass 1; `mbu_ref` / `mbu_device_ref`
divide by BENCH.md's reference read ceiling instead (REF_READ_TBPS, the unit issue 8 states
its MBU in; on other machines they judge nothing).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import jax
import numpy as np

from bench import ceilings as ceilings_mod
from jaxinfer import config, ops
from jaxinfer.runner import kv_page_bytes
from pallas_kernels import tuning
from bench.common import (burst, decode_input, dtype_name, fill_kv, load_runner, new_result,
                          pipelined_step_s, print_table, progress, save, timed, weights_name)
from bench.gpu_clocks import ClockMonitor

REF_READ_TBPS = 4.27   # shared/BENCH.md: the H200's read ceiling, the unit of issue 8's MBU

KEYS = ["model", "weights", "kv_dtype", "batch", "context", "step_ms", "step_ms_device",
        "dispatch_ms",
        "tokens_per_s", "mbu", "mbu_device", "mbu_device_ref", "intensity_flop_per_byte",
        "achieved_TFLOPs"]


def weight_bytes(params, cfg, batch: int, lm_head: str = "bf16") -> int:
    """Weight bytes one step reads: the embedding table only for B rows, unless it is tied
    and the head is bf16 (then the LM head reads it whole); with lm_head "auto" the int8
    head's codes and scales up to INT8_HEAD_MAX_ROWS rows, its dense copy above."""
    dense = lm_head == "auto" and batch > config.INT8_HEAD_MAX_ROWS   # loading.py's rule
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(path)
        nbytes = leaf.size * leaf.dtype.itemsize
        if "embed" in key and (lm_head != "bf16" or not cfg.tie_word_embeddings):
            nbytes = batch * cfg.hidden_size * leaf.dtype.itemsize
        elif "lm_head_dense" in key:
            nbytes = nbytes if dense else 0
        elif "lm_head" in key and dense:
            nbytes = 0
        total += nbytes
    return total


def kv_bytes_per_token(cfg, engine) -> int:
    """K and V of one token over all layers (+ FP8 per-token-head scales, if the pool has
    them): runner.kv_page_bytes per slot."""
    return kv_page_bytes(cfg, engine) // engine.page_size


def step_flops(cfg, batch: int, context: int) -> int:
    matmul_params = cfg.param_count() - (0 if cfg.tie_word_embeddings
                                         else cfg.vocab_size * cfg.hidden_size)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return batch * (2 * matmul_params + attention)


def step_times(runner, inp, reps: int) -> tuple[float, float, float]:
    """Seconds per step of `inp`: synced (a host round trip each), on the device (pipelined),
    and the host's dispatch in a burst of 8."""
    synced = timed(lambda: runner.step(inp), reps)
    device = pipelined_step_s(runner, inp, reps)
    dispatch = statistics.median(burst(runner, inp, 8)[0] / 8 for _ in range(3))
    return synced, device, dispatch


def measure_case(runner, cfg, model: str, batch: int, context: int, ceil: dict,
                 reps: int, rng) -> dict:
    inp = runner.prepare(decode_input(cfg, runner.engine, batch, context, rng))
    synced, device, dispatch = step_times(runner, inp, reps)
    nbytes = (weight_bytes(runner.params, cfg, batch, runner.engine.lm_head)
              + batch * (context + 1) * kv_bytes_per_token(cfg, runner.engine))
    flops = step_flops(cfg, batch, context)
    byte_floor = nbytes / (ceil["read_TBps"] * 1e12)
    ref_floor = nbytes / (REF_READ_TBPS * 1e12)
    floor = max(byte_floor, flops / (ceil["gemm_TFLOPs"] * 1e12))
    return {"model": model, "weights": weights_name(runner.engine),
            "kv_dtype": dtype_name(runner.kv.dtype), "batch": batch, "context": context,
            **({"kv_scales": "static" if runner.kv.static_scales else "token"}
               if runner.kv.is_fp8 else {}),
            **({"lm_head": runner.engine.lm_head} if runner.engine.lm_head != "bf16" else {}),
            "unroll_layers": runner.engine.unroll_layers,
            "step_ms": round(synced * 1e3, 4), "step_ms_device": round(device * 1e3, 4),
            "dispatch_ms": round(dispatch * 1e3, 4),
            "tokens_per_s": round(batch / synced, 2),
            "tokens_per_s_device": round(batch / device, 2),
            "bytes_per_step": nbytes, "flops_per_step": flops,
            "intensity_flop_per_byte": round(flops / nbytes, 3),
            "achieved_TFLOPs": round(flops / synced / 1e12, 4),
            "achieved_TBps": round(nbytes / synced / 1e12, 4),
            "floor_ms": round(floor * 1e3, 4),
            "mbu": round(byte_floor / synced, 4), "mbu_device": round(byte_floor / device, 4),
            "mbu_ref": round(ref_floor / synced, 4), "mbu_device_ref": round(ref_floor / device, 4),
            "roofline_frac": round(floor / synced, 4)}


def cases(batches, contexts, pages_left: int, page_size: int) -> tuple[list, list]:
    """(kept (B, C) pairs, skipped ones): a case needs B x ceil((C + 1) / S) pages."""
    kept, skipped = [], []
    for b in batches:
        for c in contexts:
            need = b * -(-(c + 1) // page_size)
            (kept if need <= pages_left else skipped).append((b, c))
    return kept, skipped


def run(args) -> int:
    batches, contexts = args.batch_sizes, args.contexts
    ceil = ceilings_mod.measure()
    runner, cfg, _ = load_runner(args, max_num_seqs=max(batches), max_len=max(contexts) + 1,
                                 pairs=[(b, c) for b in batches for c in contexts],
                                 kv_budget_gb=args.kv_budget_gb)
    kept, skipped = cases(batches, contexts, runner.kv.num_pages - 1, runner.engine.page_size)
    skipped = [{"model": args.model, "batch": b, "context": c, "why": "KV over --kv-budget-gb"}
               for b, c in skipped]
    result = start_result(args, ceil, skipped)
    runner.kv = fill_kv(runner.kv)
    rng = np.random.default_rng(0)
    for b, c in progress(kept, "decode cases"):
        with ClockMonitor() as clocks:
            row = measure_case(runner, cfg, args.model, b, c, ceil, args.reps, rng)
        save(result, args.out, [dict(row, gpu_clocks=clocks.summary(),
                                     run=len(result["runs"]) - 1)])
    print_table(result["rows"], KEYS)
    if result["rows"]:
        try:
            png = plot_roofline(result, str(args.out).removesuffix(".json") + "_roofline.png")
            print(f"roofline plot: {png}")
        except ImportError as e:  # the numbers matter more than the picture: keep them
            print(f"no roofline plot ({e}): install matplotlib", file=sys.stderr)
    return 0


def start_result(args, ceil: dict, skipped: list) -> dict:
    """A new results dict, or with --append the existing file's, this run added to "runs"
    (each run's own command and ceilings; its rows carry its index as "run")."""
    fresh = new_result("decode", args.git, ceilings=ceil, skipped=[], runs=[])
    run_info = {"command": fresh["command"], "ceilings": ceil,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "min_split_tokens": tuning.MIN_SPLIT_TOKENS,
                "longest_first_programs": list(tuning.LONGEST_FIRST_PROGRAMS),
                "masked_loads_min_programs": tuning.MASKED_LOADS_MIN_PROGRAMS,
                "front_norm": ops.FRONT_NORM, "fold_mlp_norm": ops.FOLD_MLP_NORM}
    path = Path(args.out)
    result = json.loads(path.read_text()) if args.append and path.exists() else fresh
    result.setdefault("runs", []).append(run_info)
    result["skipped"] = result.get("skipped", []) + skipped
    return result


def plot_roofline(result: dict, path: str) -> str:
    """Arithmetic intensity vs achieved FLOP/s of every case, under the two measured roofs:
    bandwidth x intensity (sloped) and the GEMM rate (flat). Decode points sit far left of
    the ridge, on or under the sloped roof: bandwidth-bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, ceil = result["rows"], result["ceilings"]
    ai = np.array([r["intensity_flop_per_byte"] for r in rows])
    xs = np.geomspace(min(ai.min(), 0.5) / 2, max(ai.max() * 4, 4 * ceil["gemm_TFLOPs"] /
                                                  ceil["read_TBps"]), 200)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, bw in (("read", ceil["read_TBps"]), ("copy", ceil["copy_TBps"])):
        ax.plot(xs, np.minimum(xs * bw, ceil["gemm_TFLOPs"]), "--",
                label=f"roof: {name} {bw:.3g} TB/s, GEMM {ceil['gemm_TFLOPs']:.4g} TFLOP/s")
    def series(r):  # rows of runs with --unroll-layers form their own series
        return (r["model"], r["weights"], r["kv_dtype"]) + (
            ("unrolled",) if r.get("unroll_layers") else ()) + (
            (f"{r['lm_head']} head",) if r.get("lm_head") else ())

    for key in sorted({series(r) for r in rows}):
        sel = [r for r in rows if series(r) == key]
        ax.scatter([r["intensity_flop_per_byte"] for r in sel],
                   [r["achieved_TFLOPs"] for r in sel], label="/".join(key), zorder=3)
        for r in sel:
            ax.annotate(f"B{r['batch']} C{r['context']}", (r["intensity_flop_per_byte"],
                        r["achieved_TFLOPs"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte moved)",
           ylabel="achieved TFLOP/s", title=f"decode roofline, {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
