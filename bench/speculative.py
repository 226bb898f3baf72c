"""`jaxinfer bench speculative`: what speculative decoding gains, measured in one run on one
set of weights (speculative.py has the rule; --num-speculative-tokens is k).

1. The verify step's device cost (runner, no host): a decode step of B rows vs a verify step
   of B rows x (k + 1) tokens at the same context (`verify_vs_decode`: the second over the
   first), median of --reps pipelined steps.
2. End to end (engine, greedy), per batch size and workload, `mode`:
     plain  an engine without speculation
     ngram  with speculation, prompt lookup proposing
     self   with self-speculation (the model's first --speculative-draft-layers layers)
     replay with speculation, the proposer replaying the verify steps' own greedy
            continuation, so every proposal holds: a CEILING, never a real figure.
            It starts from plain's outputs, then replays each run's outputs in the next
            (`replay_rounds`: the runs until one keeps every proposal, at most
            REPLAY_ROUNDS, the last one timed). On a GPU a verify step's logits can differ
            from a decode step's in the last bf16 bit, and synthetic weights give near-flat
            logits whose top two often tie at that precision, so the greedy tokens of
            speculative and plain decoding can part (`identical` says whether they did).
            A run's outputs are the verify steps' own continuation up to where its
            proposals first failed and one token past it, so the runs converge.
   Workloads:
     replay    (synthetic weights: random prompts of --input-len, all queued at once) plain,
               replay
     grounded  (a real model: chat prompts that quote, edit or summarise a given text, batch
               at a time) plain, ngram, self
     chat      (a real model: general chat prompts) plain, ngram, self
   Per row: output tokens/s over the whole run, `speedup` over plain's, the median step,
   mean accepted length (tokens a row gains per speculative step), acceptance rate, whether
   the outputs equal plain's token for token, compiles during the run (should be 0).
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from bench.common import (decode_input, engine_config, fill_kv, new_result, pipelined_step_s,
                          print_table, save)
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.request import SamplingParams
from jaxinfer.runner import CompileCounter

KEYS = ["batch", "workload", "mode", "output_tokens_per_s", "speedup", "step_ms",
        "mean_accepted_length", "acceptance_rate", "identical", "compiles_during_run"]
STEP_KEYS = ["batch", "context", "k", "decode_step_ms", "verify_step_ms", "verify_vs_decode"]
REPLAY_ROUNDS = 16   # replay runs at most (the last is timed)

PASSAGES = [
    "The lighthouse on the northern cape was built in 1874 from granite quarried two miles "
    "inland. Its lamp burned whale oil until 1901, then kerosene, and since 1952 it has run "
    "on electricity from the town grid. The keeper's cottage now houses a small museum that "
    "opens from May to September.",
    "To reset the router, hold the recessed button on the back panel for ten seconds until "
    "the status light blinks amber. Release it and wait two minutes while the device "
    "restarts. The network name and password return to the values printed on the label "
    "underneath.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, light "
    "splits water molecules, releasing oxygen, while the energy captured drives the "
    "synthesis of sugars from carbon dioxide. Plants use these sugars for growth and store "
    "the surplus as starch.",
    "The committee met on Tuesday and approved the budget for the new library wing. "
    "Construction will begin in March and should finish within eighteen months. The wing "
    "will add two reading rooms, a children's section and a workshop for local groups.",
]
TASKS = ["Repeat the following text exactly, word for word:", "Fix any typos in this text "
         "and return the full corrected text:", "Summarise this text in two sentences:",
         "Rewrite this text as a numbered list of facts:"]
CHAT = ["Write a short poem about autumn leaves.", "Explain how a bicycle stays upright.",
        "Give me three ideas for a rainy weekend.", "What is the difference between weather "
        "and climate?", "Describe your ideal breakfast.", "How do I boil an egg?",
        "Tell me a fun fact about octopuses.", "Why is the sky blue?"]


class ReplayProposer:
    """Proposes a known continuation of each prompt (`continuations`: prompt ids -> output
    ids): where that is the verify steps' own greedy continuation every proposal holds. A
    ceiling for the bench, never a real proposer."""

    def __init__(self, prompt_len: int, continuations: dict):
        self.prompt_len, self.continuations = prompt_len, continuations

    def propose(self, token_ids, k):
        done = len(token_ids) - self.prompt_len
        want = self.continuations.get(tuple(token_ids[:self.prompt_len]), ())
        return list(want[done:done + k])


def workloads(args, cfg, tokenizer) -> dict:
    """workload -> list of prompts (token ids or chat messages)."""
    if tokenizer is None:       # synthetic weights: random prompts, replayed continuations
        rng = np.random.default_rng(0)
        n = max(args.batch_sizes)
        return {"replay": [{"prompt_token_ids": rng.integers(3, cfg.vocab_size,
                                                             args.input_len).tolist()}
                           for _ in range(n)]}
    grounded = [[{"role": "user", "content": f"{t}\n\n{p}"}] for p in PASSAGES for t in TASKS]
    return {"grounded": grounded, "chat": [[{"role": "user", "content": c}] for c in CHAT]}


def measure(engine: Engine, groups, params) -> tuple[dict, list]:
    """Run each group of prompts to completion, one group after another (a group is one
    batch); the tokens/s, steps and speculation over all of them, and the outputs."""
    c0, s0 = CompileCounter.count(), engine.spec_stats and engine.spec_stats.as_dict()
    steps, outs = [], []
    t0 = time.perf_counter()
    for prompts in groups:
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step(deltas=False):
                done[o.request_id] = o
            steps.append(engine.last_step_s)
        outs += [list(done[i].token_ids) for i in ids]
    wall = time.perf_counter() - t0
    tokens = sum(map(len, outs))
    row = {"requests": len(outs), "output_tokens": tokens, "wall_s": round(wall, 3),
           "output_tokens_per_s": round(tokens / wall, 2),
           "step_ms": round(statistics.median(steps) * 1e3, 3), "steps": len(steps),
           "compiles_during_run": CompileCounter.count() - c0}
    if s0 is not None:
        s1 = engine.spec_stats.as_dict()
        drafts = s1["num_drafts"] - s0["num_drafts"]
        proposed = s1["num_draft_tokens"] - s0["num_draft_tokens"]
        kept = s1["num_accepted_tokens"] - s0["num_accepted_tokens"]
        row.update(drafts=drafts, mean_accepted_length=round(1 + kept / drafts, 3) if drafts
                   else None, acceptance_rate=round(kept / proposed, 4) if proposed else None)
    return row, outs


def replay_fixed_point(engine: Engine, prompts, groups, want, params, prompt_len: int) -> int:
    """Set the engine's proposer to replay the verify steps' own greedy continuation of
    `prompts`: start from `want` (plain's outputs) and replay each run's outputs in the
    next until a run keeps every proposal (module docstring). -> the runs it took (the
    next, timed run replays the same); REPLAY_ROUNDS + 1 where none kept everything."""
    def replay(outputs):
        engine.proposer = ReplayProposer(prompt_len, {
            tuple(p["prompt_token_ids"]): w for p, w in zip(prompts, outputs)})

    proposals = want
    for rounds in range(1, REPLAY_ROUNDS + 1):
        replay(proposals)
        _, outs = measure(engine, groups, params)
        if outs == proposals:
            return rounds
        proposals = outs
    replay(proposals)
    return REPLAY_ROUNDS + 1


def verify_input(cfg, engine, batch: int, context: int, k: int, rng):
    """A verify step of `batch` rows of k + 1 tokens at positions context-1 .. context+k-1
    over each row's own pages (decode_input's layout), sampling greedy."""
    import dataclasses

    from jaxinfer.kv_cache import AttentionMetadata
    from jaxinfer.sampling import SamplingArrays

    base = decode_input(cfg, engine, batch, context + k, rng)
    w = k + 1
    t = batch * w
    rows = np.repeat(np.arange(batch, dtype=np.int32), w)
    pos = np.tile(np.arange(context - 1, context - 1 + w, dtype=np.int32), batch)
    table = base.md.page_table
    s = engine.page_size
    md = AttentionMetadata(pos, table[rows, pos // s] * s + pos % s, rows, table,
                           np.full(batch, context + k, np.int32),
                           np.arange(0, t + 1, w, dtype=np.int32), decode_only=False)
    return dataclasses.replace(
        base, tokens=rng.integers(0, cfg.vocab_size, t).astype(np.int32), md=md,
        logits_index=np.arange(t, dtype=np.int32),
        sampling=SamplingArrays.from_params([], [], batch_size=t),
        prev_index=np.full(t, -1, np.int32))


def step_costs(engine: Engine, cfg, args) -> list[dict]:
    runner, k, rows = engine.runner, args.num_speculative_tokens, []
    runner.kv = fill_kv(runner.kv)
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        if batch > engine.config.speculative_rows:
            continue
        decode = runner.prepare(decode_input(cfg, runner.engine, batch, args.context, rng))
        verify = runner.prepare(verify_input(cfg, runner.engine, batch, args.context, k, rng))
        d, v = (pipelined_step_s(runner, x, args.reps) for x in (decode, verify))
        rows.append({"batch": batch, "context": args.context, "k": k,
                     "decode_step_ms": round(d * 1e3, 4), "verify_step_ms": round(v * 1e3, 4),
                     "verify_vs_decode": round(v / d, 4)})
    return rows


def run(args) -> int:
    if not args.num_speculative_tokens:
        raise SystemExit("bench speculative: --num-speculative-tokens must be > 0")
    max_batch = max(args.batch_sizes)
    spec_cfg = engine_config(args)
    spec_cfg = spec_cfg.replace(
        max_num_seqs=max_batch, enable_prefix_caching=False,
        max_model_len=max(spec_cfg.max_model_len, args.input_len + args.output_len + 1,
                          args.context + args.num_speculative_tokens + 1))
    cfg, graphdef, params, tokenizer = load_model(args.model, spec_cfg)
    plain_cfg = spec_cfg.replace(num_speculative_tokens=0)
    engines = {"plain": Engine(cfg, plain_cfg, graphdef, params, tokenizer),
               "ngram": Engine(cfg, spec_cfg.replace(speculative_method="ngram"), graphdef,
                               params, tokenizer)}
    if tokenizer is not None:     # self-speculation drafts nothing real with random weights
        engines["self"] = Engine(cfg, spec_cfg.replace(speculative_method="self"), graphdef,
                                 params, tokenizer)
    for name, engine in engines.items():
        warm = engine.warmup(progress=False, variants=("plain",))
        print(f"{name}: compiled {warm['buckets']} buckets in {warm['seconds']:.1f}s",
              file=sys.stderr, flush=True)
    result = new_result(args, model=args.model, dtype=spec_cfg.dtype, weights=args.weights,
                        kv_dtype=args.kv_dtype, k=args.num_speculative_tokens,
                        draft_layers=spec_cfg.draft_layers(cfg.num_layers),
                        speculative_disable_batch_size=spec_cfg.speculative_disable_batch_size,
                        input_len=args.input_len, output_len=args.output_len)
    result["step_cost"] = step_costs(engines["ngram"], cfg, args)
    print_table(result["step_cost"], STEP_KEYS)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                            ignore_eos=tokenizer is None)
    for workload, prompts in workloads(args, cfg, tokenizer).items():
        for batch in args.batch_sizes:
            # Synthetic: `batch` random prompts at once. Real: every prompt, `batch` at a time.
            chosen = prompts[:batch] if tokenizer is None else prompts
            groups = [chosen[i:i + batch] for i in range(0, len(chosen), batch)]
            measure(engines["plain"], [chosen[:1]], greedy)      # untimed first runs
            plain, want = measure(engines["plain"], groups, greedy)
            rows = [{"batch": batch, "workload": workload, "mode": "plain", **plain,
                     "speedup": 1.0}]
            for mode in (["replay"] if workload == "replay" else ["ngram", "self"]):
                spec = engines["ngram" if mode == "replay" else mode]
                extra = {}
                if mode == "replay":
                    extra["replay_rounds"] = replay_fixed_point(spec, chosen, groups, want,
                                                                greedy, args.input_len)
                measure(spec, [chosen[:1]], greedy)
                got, outs = measure(spec, groups, greedy)
                rows.append({"batch": batch, "workload": workload, "mode": mode, **got,
                             "speedup": round(got["output_tokens_per_s"]
                                              / plain["output_tokens_per_s"], 4),
                             "identical": outs == want, **extra})
            save(result, args.out, rows)
    print_table(result["rows"], KEYS)
    return 0
