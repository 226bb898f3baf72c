"""`jaxinfer bench lora`: what serving LoRA adapters costs, measured in one run on one set of
weights. At each batch size, the same greedy workload (every request --input-len prompt
tokens and exactly --output-len output tokens, all queued at once) runs through:
  base          an engine without LoRA (max_loras 0: no LoRA work in the step, every fused
                route the backend has)
  lora          an engine serving --adapters random adapters (rank --rank on q/k/v/o and
                gate/up/down, written in PEFT's format, synthetic like the weights), the
                rows spread over them round robin
  lora_no_rows  the LoRA engine with no row naming an adapter: the cost of LoRA being on
Both engines are compiled before timing (compiles during the runs are recorded; should be 0)
and each mode runs once untimed first (adapters loaded into their slots). Per row: output
tokens/s over the whole run, the median step, and `vs_base`: tokens/s over base's at the same
batch size. With --profile each mode's workload runs once more, after its timed run, under
the profiler (bench/profile.py): the row's `profile` holds that run's kernels per step and
its kernel families (calls, microseconds and the idle time before them, per step, the prefill
step included). The profiled run is not the timed one.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np

from bench.batching import drive
from bench.common import engine_config, new_result, print_table, save
from checkpoints.synthetic_lora import write_random_adapter
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.request import SamplingParams
from jaxinfer.runner import CompileCounter

KEYS = ["batch", "mode", "adapters", "output_tokens_per_s", "vs_base", "step_ms",
        "compiles_during_run"]
MODES = ("base", "lora", "lora_no_rows")


def workload(batch: int, args, vocab_size: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, args.input_len).tolist() for _ in range(batch)]


def profiled(engine: Engine, prompts, names, output_len: int) -> dict:
    """measure's run again under the profiler: kernels and kernel families per step."""
    from bench import profile

    run = {}
    events = profile.trace_events(lambda: run.update(measure(engine, prompts, names,
                                                             output_len)))
    summary = profile.summarize(profile.device_events(events), run["steps"])
    return {k: summary.get(k) for k in ("kernels_per_step", "busy_ms_per_step",
                                        "span_ms_per_step", "families")}


def measure(engine: Engine, prompts, names, output_len: int) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, lora=n)
              for n in names]
    for p, sp in zip(prompts, params):
        engine.add_request({"prompt_token_ids": p}, sp)
    c0, t0 = CompileCounter.count(), time.perf_counter()
    run = drive(engine, [])
    wall = time.perf_counter() - t0
    return {"output_tokens": run["tokens"], "wall_s": round(wall, 3),
            "output_tokens_per_s": round(run["tokens"] / wall, 2),
            "step_ms": round(statistics.median(run["step"]) * 1e3, 3),
            "steps": len(run["step"]), "compiles_during_run": CompileCounter.count() - c0}


def run(args) -> int:
    base_cfg = engine_config(args)
    max_batch = max(args.batch_sizes)
    base_cfg = base_cfg.replace(max_num_seqs=max_batch, enable_prefix_caching=False,
                                max_model_len=args.input_len + args.output_len + 1)
    cfg, graphdef, params, tokenizer = load_model(args.model, base_cfg)
    lora_cfg = base_cfg.replace(max_loras=args.adapters, max_lora_rank=args.rank,
                                max_cpu_loras=args.adapters)
    engines = {"base": Engine(cfg, base_cfg, graphdef, params, tokenizer),
               "lora": Engine(cfg, lora_cfg, graphdef, params, tokenizer)}
    for name, engine in engines.items():
        warm = engine.warmup(progress=False)
        print(f"{name}: compiled {warm['buckets']} buckets in {warm['seconds']:.1f}s",
              file=sys.stderr, flush=True)
    names = [f"adapter-{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            engines["lora"].load_lora(name, write_random_adapter(
                f"{tmp}/{name}", cfg, rank=args.rank, seed=i, std=0.01, dtype=np.float16))
    result = new_result(args, model=args.model, dtype=base_cfg.dtype, weights=args.weights,
                        kv_dtype=args.kv_dtype, adapters=args.adapters, rank=args.rank,
                        input_len=args.input_len, output_len=args.output_len)
    for batch in args.batch_sizes:
        prompts = workload(batch, args, cfg.vocab_size, seed=batch)
        per_mode = {"base": (engines["base"], [None] * batch),
                    "lora": (engines["lora"], [names[i % len(names)] for i in range(batch)]),
                    "lora_no_rows": (engines["lora"], [None] * batch)}
        got = {}
        for mode in MODES:
            engine, rows_names = per_mode[mode]
            k = min(batch, args.adapters)         # every adapter in its slot, caches warm
            measure(engine, prompts[:k], rows_names[:k], 4)
            got[mode] = measure(engine, prompts, rows_names, args.output_len)
            if args.profile:
                got[mode]["profile"] = profiled(engine, prompts, rows_names, args.output_len)
        save(result, args.out, [
            {"batch": batch, "mode": mode,
             "adapters": 0 if mode != "lora" else min(batch, args.adapters), **got[mode],
             "vs_base": round(got[mode]["output_tokens_per_s"]
                              / got["base"]["output_tokens_per_s"], 4)} for mode in MODES])
    print_table(result["rows"], KEYS)
    return 0
