"""`jaxinfer bench decode`: the decode step against its roofline.

For every batch B and context C: B rows, each decoding its token C at position C-1 over C-1
cached tokens, run through `ModelRunner` (the serving step: forward + logits + sampling, KV
donated) with a scheduler-free StepInput; the cache holds pseudo-random values (never zeros).
  step_ms         back-to-back `runner.step` calls, each syncing on its sampled tokens (what
                  serving sees); median per call
  step_ms_device  steps dispatched back to back, no host round trip
                  (bench.common.pipelined_step_s)
  dispatch_ms     host time to enqueue one step: near step_ms_device, the host sets the pace
  gpu_clocks      SM clock and board power through the case (bench/gpu_clocks.py)
Bytes per step: every weight read once (embeddings: only the B looked-up rows; the LM head
whole) + the KV of B x C tokens read + the new tokens' KV written. FLOPs: 2 x matmul params x
B + attention (4 x L x H x D x C x B). MBU = (bytes / read_TBps) / step time; roofline_frac =
max(byte floor, FLOP floor) / step time, against ceilings measured in the same run.
`mbu_ref` / `mbu_device_ref` divide by the H200's measured read ceiling (REF_READ_TBPS) instead,
since an XLA read probe under-measures HBM; on other machines they judge nothing.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import jax
import numpy as np

from bench import ceilings as ceilings_mod
from bench.common import (burst, decode_input, dtype_name, fill_kv, load_runner, new_result,
                          pipelined_step_s, print_table, progress, save, timed, weights_name)
from bench.gpu_clocks import ClockMonitor
from jaxinfer.roofline import weight_bytes
from jaxinfer.kv_cache import kv_page_bytes

REF_READ_TBPS = 4.27   # the H200's measured read ceiling (docs/performance.md)

KEYS = ["model", "weights", "kv_dtype", "batch", "context", "step_ms", "step_ms_device",
        "dispatch_ms", "tokens_per_s", "mbu", "mbu_device", "mbu_device_ref",
        "intensity_flop_per_byte", "achieved_TFLOPs"]


def kv_bytes_per_token(cfg, engine) -> int:
    """K and V of one token over all layers (+ FP8 per-token-head scales, if the pool has
    them): kv_cache.kv_page_bytes per slot."""
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
    return 0


def start_result(args, ceil: dict, skipped: list) -> dict:
    """A new results dict, or with --append the existing file's, this run added to "runs"
    (each run's own command and ceilings; its rows carry its index as "run")."""
    fresh = new_result(args, ceilings=ceil, skipped=[], runs=[])
    run_info = {"command": fresh["command"], "git": fresh["git"], "ceilings": ceil,
                "xla_flags": os.environ.get("XLA_FLAGS", "")}
    path = Path(args.out)
    result = json.loads(path.read_text()) if args.append and path.exists() else fresh
    result.setdefault("runs", []).append(run_info)
    result["skipped"] = result.get("skipped", []) + skipped
    return result
