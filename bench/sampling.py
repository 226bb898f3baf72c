"""`jaxinfer bench sampling`: what the sampling features cost, measured in one run on one set of
weights.

structured  --batch requests (--input-len random prompt tokens, at most --output-len output
            tokens, temperature 1, seeded), all queued at once, twice on one engine:
              unconstrained  no grammar
              json_schema    every request held to SCHEMA (an object: a short string, an
                             enum array, a number, then a string of at least 4,000
                             characters, so random weights write until --output-len)
            Per mode: output tokens/s over the run, the median step and host time, mean
            output length; `vs_unconstrained`: tokens/s over the unconstrained run's.
n           one request with a --n-prompt-len token prompt and --n-output-len tokens, asked
            for n = 1 and n = --n completions (--reps times each, a fresh prompt each time,
            prefix caching off): the prompt tokens the engine computed for it (counted in the
            scheduler's output), and its TTFT: add_request to the first token of any
            completion (`ttft_ms`) and of all of them (`ttft_all_ms`), medians;
            `ttft_vs_n1`: n's TTFT over n = 1's.
Both engines are compiled before timing (compiles during the runs are recorded; should be 0).
Structured output needs a tokenizer: the model's, or `--tokenizer` (a tokenizer.json) for
synthetic weights, whose vocabulary is then padded to the model's (the extra ids are never
allowed).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from bench.batching import drive, phase_medians
from bench.common import engine_config, new_result, print_table, save
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.request import SamplingParams
from jaxinfer.runner import CompileCounter
from jaxinfer.tokenizer import Tokenizer

KEYS = ["case", "mode", "batch", "output_tokens_per_s", "vs_unconstrained", "step_ms",
        "host_ms_per_step", "prompt_tokens_computed", "ttft_ms", "ttft_all_ms", "ttft_vs_n1",
        "compiles_during_run"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "minItems": 2, "maxItems": 4},
                         "score": {"type": "number"},
                         "text": {"type": "string", "minLength": 4000}},
          "required": ["name", "tags", "score", "text"], "additionalProperties": False}


def _engine(loaded, cfg, args) -> Engine:
    model_cfg, graphdef, params, tokenizer = loaded
    engine = Engine(model_cfg, cfg, graphdef, params, tokenizer, model_name=args.model)
    warm = engine.warmup(progress=False)
    print(f"compiled {warm['buckets']} buckets in {warm['seconds']:.1f}s", file=sys.stderr,
          flush=True)
    return engine


def structured_rows(loaded, base, args) -> list[dict]:
    cfg = base.replace(max_num_seqs=args.batch,
                       max_model_len=args.input_len + args.output_len + 1)
    engine = _engine(loaded, cfg, args)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, loaded[0].vocab_size, args.input_len).tolist()
               for _ in range(args.batch)]
    rows = []
    for mode in ("unconstrained", "json_schema", "unconstrained", "json_schema"):
        params = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.output_len,
                                 ignore_eos=mode == "unconstrained",
                                 structured_outputs=({"json": SCHEMA}
                                                     if mode == "json_schema" else None))
                  for i in range(args.batch)]
        for p, sp in zip(prompts, params):
            engine.add_request({"prompt_token_ids": p}, sp)
        c0, t0 = CompileCounter.count(), time.perf_counter()
        run = drive(engine, [])
        wall = time.perf_counter() - t0
        rows.append({"case": "structured", "mode": mode, "batch": args.batch,
                     "output_tokens": run["tokens"], "wall_s": round(wall, 3),
                     "output_tokens_per_s": round(run["tokens"] / wall, 2),
                     "mean_output_len": round(run["tokens"] / args.batch, 1),
                     "step_ms": round(statistics.median(run["step"]) * 1e3, 3),
                     "host_ms_per_step": round(statistics.median(
                         s - w for s, w in zip(run["step"], (p["wait"] for p in run["phases"])))
                         * 1e3, 3),
                     "host_phases_ms": phase_medians(run["phases"]),
                     "steps": len(run["step"]), "compiles_during_run": CompileCounter.count() - c0})
    rows = rows[2:]       # the first pair warmed the grammar cache and the host paths
    for r in rows:
        r["vs_unconstrained"] = round(r["output_tokens_per_s"] / rows[0]["output_tokens_per_s"],
                                      4)
    return rows


def _prompt_tokens_counter(engine: Engine, prompt_len: int) -> list[int]:
    """A one-element list that counts the prompt tokens (positions < prompt_len) every later
    step computes."""
    fed = [0]
    schedule = engine.scheduler.schedule

    def counted(*a, **kw):
        out = schedule(*a, **kw)
        fed[0] += sum(max(0, min(r.seq_len, prompt_len) - r.start_pos) for r in out.rows)
        return out
    engine.scheduler.schedule = counted
    return fed


def ttft(engine: Engine, prompt, params: SamplingParams) -> tuple[float, float]:
    """(first token of any completion, of every completion) in seconds after add_request;
    runs the request to the end."""
    t0 = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, params)
    first: dict[int, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                if c.token_ids and c.index not in first:
                    first[c.index] = time.perf_counter() - t0
    return min(first.values()), max(first.values())


def n_rows(loaded, base, args) -> list[dict]:
    cfg = base.replace(max_num_seqs=max(args.n, 8), enable_prefix_caching=False,
                       max_model_len=args.n_prompt_len + args.n_output_len + 1)
    engine = _engine(loaded, cfg, args)
    fed = _prompt_tokens_counter(engine, args.n_prompt_len)
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for n in (1, args.n, 1, args.n):          # the first pair warms the paths untimed
        params = SamplingParams(n=n, temperature=1.0, seed=args.seed,
                                max_tokens=args.n_output_len, ignore_eos=True)
        c0, fed[0] = CompileCounter.count(), 0
        times = [ttft(engine, rng.integers(3, loaded[0].vocab_size, args.n_prompt_len).tolist(),
                      params) for _ in range(args.reps)]
        rows.append({"case": "n", "mode": f"n={n}", "n": n, "prompt_len": args.n_prompt_len,
                     "prompt_tokens_computed": fed[0] // args.reps,
                     "ttft_ms": round(statistics.median(t for t, _ in times) * 1e3, 3),
                     "ttft_all_ms": round(statistics.median(t for _, t in times) * 1e3, 3),
                     "reps": args.reps, "compiles_during_run": CompileCounter.count() - c0})
    rows = rows[2:]
    for r in rows:
        r["ttft_vs_n1"] = round(r["ttft_ms"] / rows[0]["ttft_ms"], 4)
    return rows


def run(args) -> int:
    base = engine_config(args)
    loaded = load_model(args.model, base)
    if args.tokenizer:
        loaded = (*loaded[:3], Tokenizer.from_file(args.tokenizer))
    if loaded[3] is None and "structured" in args.cases:
        print("the structured case needs a tokenizer: this model has none; pass --tokenizer "
              "PATH/tokenizer.json", file=sys.stderr)
        return 2
    result = new_result(args, model=args.model, dtype=base.dtype, weights=args.weights,
                        kv_dtype=args.kv_dtype, async_scheduling=base.async_scheduling,
                        tokenizer_vocab=(None if loaded[3] is None
                                         else loaded[3].backend.get_vocab_size()),
                        vocab_size=loaded[0].vocab_size, schema=json.dumps(SCHEMA))
    if "structured" in args.cases:
        save(result, args.out, structured_rows(loaded, base, args))
    if "n" in args.cases:
        save(result, args.out, n_rows(loaded, base, args))
    print_table(result["rows"], KEYS)
    return 0
