"""`jaxinfer bench compile`: what compiling every bucket of an engine config costs, and what
the compiled step contains.

Per bucket (`Buckets.all_buckets()`), in this process with a fresh persistent cache dir: the
runner's jitted step traced, lowered and compiled ahead of time (with the XLA options warm-up
gives it, Routes.compiler_options), each phase timed
(`cold_serial_sum_s`: their sum). Then what a server start pays, each in a fresh child process through the real Engine: load
the weights, Engine.warmup (both sampling variants of every bucket, compiled in a thread pool),
then one request's first token; timed from the child's spawn to that token:
  cold_*   with a second fresh cache dir (nothing to hit)
  warm_*   reusing that dir: what a restarted server pays
--startup-only skips the serial per-bucket pass (minutes at 512 rows); its rows are then the
two starts (`phase` cold and warm).
The executables' optimized HLO is read by bench/hlo.py (kernels per step and per decoder
layer, fused op sets, custom calls, command-buffer coverage), plus their memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from bench import hlo
from bench.common import (engine_argv, engine_config, load_runner, new_result, print_table,
                          progress, save)

KEYS = ["bucket", "trace_s", "lower_s", "compile_s", "kernels_per_step",
        "kernels_per_layer", "command_buffers", "temp_MB"]
_cache_hits = [0]


def enable_cache(cache_dir: str) -> None:
    """Persist every executable, however small or quick to compile."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    def on_event(name, **_kw):
        if name == "/jax/compilation_cache/cache_hits":
            _cache_hits[0] += 1
    jax.monitoring.register_event_listener(on_event)


def bucket_name(b) -> str:
    return f"{'decode' if b.decode_only else 'mixed'} T{b.num_tokens} B{b.num_seqs} " \
           f"W{b.pages_per_seq}"


def compile_bucket(runner, bucket):
    """(row of phase seconds, compiled executable) for one bucket."""
    from jaxinfer.step_input import dummy_input

    inp = runner.prepare(dummy_input(bucket, max_num_seqs=runner.engine.max_num_seqs))
    hits = _cache_hits[0]
    t0 = time.perf_counter()
    # The runner's own jitted step (same function and static args as serving).
    traced = runner.trace(inp)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile(compiler_options=runner.compiler_options(inp) or None)
    t3 = time.perf_counter()
    return {"bucket": bucket_name(bucket), "num_tokens": bucket.num_tokens,
            "num_seqs": bucket.num_seqs, "pages_per_seq": bucket.pages_per_seq,
            "decode_only": bucket.decode_only, "trace_s": round(t1 - t0, 3),
            "lower_s": round(t2 - t1, 3), "compile_s": round(t3 - t2, 3),
            "total_s": round(t3 - t0, 3), "cache_hit": _cache_hits[0] > hits}, compiled


def describe(compiled, num_layers: int) -> dict:
    a = hlo.analyze(compiled.as_text(), num_layers)
    row = {k: a[k] for k in ("kernels_per_step", "kernels_per_layer", "conditional_kernels",
                             "command_buffer_coverage")}
    row["command_buffers"] = a["command_buffers_per_step"]
    row["custom_calls"] = a["custom_call_targets"]
    mem = compiled.memory_analysis()
    if mem is not None:
        for field in ("temp", "argument", "output", "alias", "generated_code"):
            row[f"{field}_MB"] = round(getattr(mem, f"{field}_size_in_bytes") / 2**20, 3)
    return row, a


def compile_all(args, analyze: bool):
    """Rows (one per bucket) and the HLO analysis of the smallest decode bucket."""
    runner, cfg, _ = load_runner(args, max_num_seqs=args.max_num_seqs,
                                 max_len=args.max_model_len)
    from jaxinfer.buckets import Buckets

    rows, decode_hlo = [], None
    buckets = Buckets.from_config(runner.engine).all_buckets()
    for bucket in progress(buckets, "compiling"):
        row, compiled = compile_bucket(runner, bucket)
        if analyze:
            extra, full = describe(compiled, cfg.num_layers)
            row.update(extra)
            if bucket.decode_only and decode_hlo is None:
                decode_hlo = dict(full, bucket=row["bucket"])
        rows.append(row)
    return rows, decode_hlo


def startup_to_first_token(args) -> dict:
    """(Child process) A server's start: the model loaded, Engine.warmup's compile (both
    sampling variants of every bucket), then one greedy request stepped to its first token.
    Seconds of each phase, executables, persistent-cache hits, and the wall-clock time of the
    first token (the parent subtracts the spawn time)."""
    from jaxinfer.engine import Engine
    from jaxinfer.loading import load_model
    from jaxinfer.request import SamplingParams

    ecfg = engine_config(args)
    t0 = time.perf_counter()
    cfg, graphdef, params, tokenizer = load_model(args.model, ecfg)
    engine = Engine(cfg, ecfg, graphdef, params, tokenizer, model_name=args.model)
    t1 = time.perf_counter()
    hits = _cache_hits[0]
    warm = engine.warmup(progress=False)
    t2, c2 = time.perf_counter(), Engine.compiles()
    engine.add_request({"prompt_token_ids": [1] * 8},
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while not any(o.finished for o in engine.step()):
        pass
    t3 = time.perf_counter()
    return {"first_token_unix": time.time(), "load_s": round(t1 - t0, 3),
            "wall_s": round(t2 - t1, 3), "first_step_s": round(t3 - t2, 3),
            "executables": warm["compiles"] + warm["loaded_from_cache"] +
            warm["loaded_from_store"], "loaded_from_store": warm["loaded_from_store"],
            "buckets": warm["buckets"], "cache_hits": _cache_hits[0] - hits,
            "tracing_s": round(warm["lower_seconds"], 3),
            "compiling_s": round(warm["compile_seconds"], 3),
            "compiles_after_warmup": Engine.compiles() - c2,
            "workers": os.cpu_count() or 1}


def child(args, phase: str, cache_dir: str) -> dict:
    """Run `phase` in a fresh process; its result, the process's wall time and the time from
    its spawn to its first token."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{phase}.json"
        cmd = [sys.executable, "-m", "bench.cli", "compile", "--phase", phase,
               "--cache-dir", cache_dir, "--out", str(out), *engine_argv(args)]
        spawned, t = time.time(), time.perf_counter()
        subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parent.parent)
        wall = time.perf_counter() - t
        got = json.loads(out.read_text())
        return dict(got, process_wall_s=round(wall, 2),
                    to_first_token_s=round(got.pop("first_token_unix") - spawned, 2))


def run(args) -> int:
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jaxinfer_cache_")
    enable_cache(cache_dir)
    if args.phase in ("cold", "warm"):  # a child: the start-up compile only
        Path(args.out).write_text(json.dumps(startup_to_first_token(args)) + "\n")
        return 0
    result = new_result(args, model=args.model,
                        cache_dir=args.cache_dir or "(a fresh temporary directory)")
    if not args.startup_only:
        rows, decode_hlo = compile_all(args, analyze=True)
        result.update(cold_serial_sum_s=round(sum(r["total_s"] for r in rows), 2),
                      kernels_per_layer=decode_hlo and decode_hlo["kernels_per_layer"],
                      decode_step_hlo=decode_hlo)
        save(result, args.out, rows)
    if not args.no_warm:
        startup_dir = tempfile.mkdtemp(prefix="jaxinfer_cache_startup_")
        try:
            for phase in ("cold", "warm"):
                got = child(args, phase, startup_dir)
                result[f"{phase}_startup"] = got
                result[f"{phase}_total_s"] = got["wall_s"]
                result[f"{phase}_to_first_token_s"] = got["to_first_token_s"]
                save(result, args.out, [dict(phase=phase, **got)] if args.startup_only else [])
        except subprocess.CalledProcessError as e:  # the serial rows are saved already
            result["startup_error"] = f"child process exited with {e.returncode}"
            save(result, args.out)
            return 1
    if not args.startup_only:
        print_table(result["rows"], KEYS)
    print(f"serial sum {result.get('cold_serial_sum_s')} s; start-up compile (both variants, "
          f"parallel): cold {result.get('cold_total_s')} s, warm {result.get('warm_total_s')}"
          f" s; spawn to first token: cold {result.get('cold_to_first_token_s')} s, warm "
          f"{result.get('warm_to_first_token_s')} s; kernels per decoder layer (decode step) "
          f"{result.get('kernels_per_layer')}")
    return 0
