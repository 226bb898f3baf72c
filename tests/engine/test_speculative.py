"""Speculative decoding on the tiny model: outputs as without it (greedy and seeded tokens
identical, unseeded draws from the same distribution), its stand-aside rules, no pages
leaked through aborts and preemptions mid-speculation, nothing compiled after warm-up."""
import argparse
import dataclasses
import io
import json

import numpy as np
import pytest
from scipy import stats

import jax.numpy as jnp

from checkpoints.model_state import build_model
from dense_reference import random_flat
from engine_util import TINY, random_prompts, tiny_engine, tiny_model
from jaxinfer.args import add_engine_args, engine_config_from_args
from jaxinfer.batch_generate import generate_file
from jaxinfer.buckets import Buckets
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.errors import ConfigError
from jaxinfer.request import Request, SamplingParams
from jaxinfer.runner import CompileCounter
from jaxinfer.scheduler import Scheduler
from jaxinfer.speculative import NgramProposer, SpecStats, accepted_count

K = 3


def looping_prompts(n, seed=0):
    """Prompts that repeat a short phrase: the ngram proposer finds matches at once."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(3, 500, int(rng.integers(2, 6))).tolist()
        out.append({"prompt_token_ids": phrase * int(rng.integers(2, 5))
                    + phrase[:int(rng.integers(0, len(phrase)))]})
    return out


def generate(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = engine.run_until_done(use_tqdm=False)
    return [done[i] for i in ids]


# --- the proposer and the acceptance count -------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(n_min=1, n_max=3)
    #            0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert p.propose(context, 2) == [9, 2]              # "6 7" last seen at 5: then 9 2
    assert p.propose(context + [9], 4) == [2, 6, 7, 9]  # "6 7 9" at 5..7, then the rest
    assert p.propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]   # runs to the end of the context
    assert p.propose([1, 2, 3, 4], 3) == []             # nothing recurs
    assert NgramProposer(n_min=2, n_max=3).propose([4, 1, 9, 1], 3) == []  # "1" is too short
    assert p.propose([7], 3) == [] and p.propose([7, 7], 2) == [7]


def test_accepted_count_and_stats():
    assert accepted_count([4, 5, 6], [4, 5, 6]) == 3
    assert accepted_count([4, 9, 6], [4, 5, 6]) == 1
    assert accepted_count([1], [2]) == 0 and accepted_count([], []) == 0
    s = SpecStats(3)
    s.record(3, 2)
    s.record(3, 0)
    s.record(0, 0)          # a row with no proposal is no draft
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 2)
    assert s.accepted_per_pos == [1, 1, 0]
    assert s.acceptance_rate == pytest.approx(2 / 6)
    assert s.mean_accepted_length == pytest.approx(2.0)


# --- exactness -------------------------------------------------------------------------------
def test_greedy_outputs_are_identical_and_proposals_are_kept():
    prompts = looping_prompts(5, seed=1) + random_prompts(3, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m))
              for m in (40, 1, 2, 25, 40, 33, 5, 40)]
    plain_engine = tiny_engine()
    plain = generate(plain_engine, prompts, params)
    engine = tiny_engine(num_speculative_tokens=K)
    spec = generate(engine, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    got = engine.spec_stats
    # The looping prompts make proposals that hold, at every position.
    assert got.num_drafts > 10 and got.num_accepted_tokens > got.num_drafts
    assert all(n > 0 for n in got.accepted_per_pos)
    assert engine.num_steps < plain_engine.num_steps


def test_self_speculation_drafts_with_the_first_layers_on_the_device():
    """speculative_method "self": the model's first layers draft. With every layer drafting
    the draft is the model itself, so every greedy proposal holds (the draft program's
    positions, K/V writes and attention are right); with one it is an early exit whose
    proposals mostly fail, and outputs stay identical either way."""
    prompts = looping_prompts(3, seed=7) + random_prompts(3, seed=8)
    params = ([SamplingParams(temperature=0.0, max_tokens=30)] * 3
              + [SamplingParams(temperature=0.8, seed=3, max_tokens=25, logprobs=1)] * 3)
    want = generate(tiny_engine(), prompts, params)
    whole = tiny_engine(num_speculative_tokens=K, speculative_method="self",
                        speculative_draft_layers=2)
    greedy = [SamplingParams(temperature=0.0, max_tokens=30)] * 6
    got = generate(whole, prompts, greedy)
    assert [o.token_ids for o in got[:3]] == [o.token_ids for o in want[:3]]
    assert whole.spec_stats.num_drafts > 20 and whole.spec_stats.acceptance_rate == 1.0
    early = tiny_engine(num_speculative_tokens=K, speculative_method="self",
                        speculative_draft_layers=1)
    assert early.proposer.num_layers == 1
    got = generate(early, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert early.spec_stats.num_drafts > 10
    with pytest.raises(ConfigError, match="exceeds the model's 2 layers"):
        tiny_engine(num_speculative_tokens=K, speculative_method="self",
                    speculative_draft_layers=3)


def draft_engine(seed=None, **kw):
    """The tiny model drafted for by the tiny model: with its own weights (seed None: every
    greedy proposal holds) or random ones of `seed`."""
    graphdef, params = tiny_model()
    if seed is not None:
        graphdef, params = build_model(TINY, random_flat(TINY, seed=seed, std=0.08),
                                       jnp.float32)
    cfg = EngineConfig(**{"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                          "page_size": 4, "num_speculative_tokens": K,
                          "speculative_method": "draft", "speculative_model": "tiny", **kw})
    return Engine(TINY, cfg, *tiny_model(), draft_model=(TINY, graphdef, params))


def test_a_draft_model_drafts_with_its_own_cache():
    """speculative_method "draft": a model of the same vocabulary drafts from its own K/V
    pool on the engine's pages, catching up on the tokens it has not seen. The model as its
    own draft: every greedy proposal holds (its pool is right: catch-up, drafted positions,
    kept counts); another model's proposals fail; outputs are identical either way."""
    prompts = looping_prompts(3, seed=11) + random_prompts(3, seed=12)
    params = ([SamplingParams(temperature=0.0, max_tokens=30)] * 3
              + [SamplingParams(temperature=0.8, seed=3, max_tokens=25, logprobs=1)] * 3)
    want = generate(tiny_engine(), prompts, params)
    same = draft_engine()
    greedy = [SamplingParams(temperature=0.0, max_tokens=30)] * 6
    assert [o.token_ids for o in generate(same, prompts, greedy)[:3]] == [
        o.token_ids for o in want[:3]]
    assert same.spec_stats.num_drafts > 20 and same.spec_stats.acceptance_rate == 1.0
    # Again on the same pages and prefix-cache hits: its pool is caught up again, not trusted.
    before = same.spec_stats.as_dict()
    generate(same, prompts, greedy)
    assert same.spec_stats.since(before)["acceptance_rate"] == 1.0
    other = draft_engine(seed=12)
    assert [o.token_ids for o in generate(other, prompts, params)] == [
        o.token_ids for o in want]
    assert other.spec_stats.num_drafts > 20
    assert other.scheduler.allocator.num_used == 0


def test_a_draft_model_must_share_the_vocabulary():
    with pytest.raises(ConfigError, match="speculative_model"):
        EngineConfig(num_speculative_tokens=2, speculative_method="draft")
    small = dataclasses.replace(TINY, vocab_size=256)
    graphdef, params = build_model(small, random_flat(small, seed=1, std=0.08), jnp.float32)
    cfg = EngineConfig(max_model_len=128, page_size=4, max_num_batched_tokens=64,
                       num_speculative_tokens=2, speculative_method="draft",
                       speculative_model="small")
    with pytest.raises(ConfigError, match="vocabulary of 256 tokens; the model's has 512"):
        Engine(TINY, cfg, *tiny_model(), draft_model=(small, graphdef, params))


def test_seeded_sampling_penalties_logprobs_and_stops_are_identical():
    """Each verified token is drawn as a plain step draws it there: same key, penalties,
    banned ids; so seeded outputs are the very same tokens, logprobs included."""
    prompts = looping_prompts(6, seed=3)
    base = [SamplingParams(temperature=0.8, seed=5, max_tokens=40),
            SamplingParams(temperature=1.0, seed=7, max_tokens=30, repetition_penalty=1.3,
                           logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=25, min_tokens=20),
            SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=33,
                           presence_penalty=0.5, frequency_penalty=0.3),
            SamplingParams(temperature=0.5, top_p=0.8, seed=11, max_tokens=40, logprobs=0),
            SamplingParams(temperature=0.0, max_tokens=40, logprobs=3)]
    plain = generate(tiny_engine(), prompts, base)
    # A stop token from the middle of each plain output: the run must end exactly there.
    stopped = [dataclasses.replace(p, stop_token_ids=(o.token_ids[len(o.token_ids) // 2],))
               for p, o in zip(base, plain)]
    plain_stopped = generate(tiny_engine(), prompts, stopped)
    engine = tiny_engine(num_speculative_tokens=K)
    for params, want in ((base, plain), (stopped, plain_stopped)):
        got = generate(engine, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        for g, w in zip(got, want):
            assert (g.logprobs is None) == (w.logprobs is None)
            for a, b in zip(g.logprobs or (), w.logprobs or ()):
                assert a.keys() == b.keys()
                np.testing.assert_allclose([v.logprob for v in a.values()],
                                           [v.logprob for v in b.values()], atol=1e-4)
                assert [v.rank for v in a.values()] == [v.rank for v in b.values()]
    assert engine.spec_stats.num_accepted_tokens > 20


class FixedProposer:
    """Proposes one token k times: the rejection rule holds for any proposer."""

    def __init__(self, token: int):
        self.token = token

    def propose(self, token_ids, k):
        return [self.token] * k


def test_unseeded_draws_keep_the_models_distribution():
    """Unseeded tokens take other random bits with speculation, so compare distributions:
    the 2nd and 3rd tokens of many draws, with and without speculation, by chi-square tests
    of homogeneity. The proposal is the most frequent 2nd token (some 20% of draws): often
    kept, often not."""
    prompt = {"prompt_token_ids": [115, 139] + [268] * 6}
    params = SamplingParams(temperature=0.15, max_tokens=4, ignore_eos=True)
    draws, shape = 480, dict(max_num_seqs=16, max_num_batched_tokens=128)

    def tokens(engine):
        outs = generate(engine, [prompt] * draws, [params] * draws)
        return [[o.token_ids[i] for o in outs] for i in (1, 2)]
    plain = tokens(tiny_engine(seed=1, **shape))
    engine = tiny_engine(seed=2, num_speculative_tokens=K, speculative_disable_batch_size=16,
                         **shape)
    # In this burst the rows finish out of step (verify steps keep different numbers of
    # tokens), and a step admitting a few prompts beside the decode rows often lands a few
    # tokens over a shape (34 tokens: a 64-token shape); the scheduler's shape fit cuts them
    # off the last prompt, which keeps that row out of decode for a step, and a verify step
    # needs every row in decode. Off here, so most steps verify and the test sees many kept
    # and rejected proposals.
    engine.scheduler.token_shapes = ()
    common = max(set(plain[0]), key=plain[0].count)
    engine.proposer = FixedProposer(common)
    spec = tokens(engine)
    got = engine.spec_stats
    assert got.num_drafts > draws // 2 and 0.05 < got.acceptance_rate < 0.5, got
    for a, b in zip(plain, spec):
        values = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in values], [b.count(t) for t in values]])
        # Tokens seen fewer than 10 times in all pooled into one column (chi-square's rule
        # of thumb on expected counts).
        rare = table.sum(0) < 10
        table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)])
        table = table[:, table.sum(0) > 0]
        assert table.shape[1] >= 4, table     # a distribution, not one token
        assert stats.chi2_contingency(table).pvalue > 1e-3, table


# --- when it stands aside, and what it never does ---------------------------------------------
def test_no_speculation_above_the_batch_size_or_with_a_grammar():
    prompts = looping_prompts(3, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=20)] * 3
    engine = tiny_engine(num_speculative_tokens=K, speculative_disable_batch_size=2)
    assert [o.token_ids for o in generate(engine, prompts, params)] == [
        o.token_ids for o in generate(tiny_engine(), prompts, params)]
    # Three running rows: none until one finishes; short ones finish first below.
    assert engine.spec_stats.num_drafts == 0
    short = [SamplingParams(temperature=0.0, max_tokens=m) for m in (2, 30, 30)]
    generate(engine, prompts, short)
    assert engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_nothing_leaks_through_aborts_and_preemptions_mid_speculation(method):
    """A pool too small for every row's proposals: verify steps preempt; requests aborted
    between steps; the rest finish as they would without speculation (the draft model's
    pool recomputed for the preempted ones)."""
    prompts = looping_prompts(6, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 6
    small = dict(num_pages=34, max_num_seqs=6, speculative_disable_batch_size=6,
                 num_speculative_tokens=4)
    want = generate(tiny_engine(num_pages=34), prompts, params)
    engine = (draft_engine(**small) if method == "draft"
              else tiny_engine(speculative_method=method, **small))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, step = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        step += 1
        if step == 12:
            for i in (1, 4):
                final[ids[i]] = engine.abort_request(ids[i])
    sched = engine.scheduler
    assert engine.spec_stats.num_drafts > 0 and sched.num_preemptions > 0
    assert sched.allocator.num_used == 0 and not sched.running and not sched.waiting
    for i in (0, 2, 3, 5):
        assert final[ids[i]].token_ids == want[i].token_ids
    assert final[ids[1]].finish_reason == "cancelled"


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_nothing_compiles_after_warmup(method):
    engine = (draft_engine(seed=5) if method == "draft"
              else tiny_engine(num_speculative_tokens=K, speculative_method=method))
    warm = engine.warmup(progress=False)
    verify = [b for b in engine.buckets.all_buckets() if b.verify]
    assert verify and warm["buckets"] == len(engine.buckets.all_buckets())
    before = CompileCounter.count()
    prompts = looping_prompts(5, seed=6)
    generate(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=30)] * 5)
    generate(engine, prompts, [SamplingParams(temperature=0.9, seed=3, max_tokens=30,
                                              logprobs=1, repetition_penalty=1.2)] * 5)
    assert engine.spec_stats.num_drafts > 0
    assert CompileCounter.count() == before


def test_the_offline_summary_reports_speculation(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({**p, "max_tokens": 30, "temperature": 0,
                                       "ignore_eos": True}) + "\n"
                           for p in looping_prompts(4, seed=9)))
    engine = tiny_engine(num_speculative_tokens=K)
    generate(engine, looping_prompts(2, seed=10), [SamplingParams(max_tokens=20)] * 2)
    before = engine.spec_stats.as_dict()
    summary = generate_file(engine, inp, out, log=io.StringIO())
    got = summary["speculative"]
    now = engine.spec_stats.as_dict()
    assert 0 < got["num_drafts"] == now["num_drafts"] - before["num_drafts"]
    assert got["num_accepted_tokens"] == now["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert got["mean_accepted_length"] == pytest.approx(1 + got["num_accepted_tokens"]
                                                        / got["num_drafts"], abs=1e-4)
    assert summary["output_tokens"] == 4 * 30
    assert "speculative" not in generate_file(tiny_engine(), inp, tmp_path / "o2.jsonl",
                                              log=io.StringIO())


# --- the pieces: buckets, scheduler, config -------------------------------------------------
def test_verify_buckets():
    b = Buckets(32, 256, 8, num_speculative_tokens=3, speculative_rows=8)
    verify = [x for x in b.all_buckets() if x.verify]
    assert [(x.num_tokens, x.num_seqs, x.num_samples) for x in verify] == [
        (4, 1, 4), (8, 2, 8), (16, 4, 16), (32, 8, 32)]
    got = b.choose_verify(9, 3, 5)
    assert (got.num_tokens, got.num_seqs, got.verify) == (16, 4, True)
    with pytest.raises(ValueError, match="num_seqs"):
        b.choose_verify(40, 9, 5)
    with pytest.raises(ValueError, match="holds 3 to 12 tokens"):
        b.choose_verify(13, 3, 5)
    assert not [x for x in Buckets(32, 256, 8).all_buckets() if x.verify]


def test_scheduler_cuts_proposals_to_the_room_left_and_keeps_counts():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, page_size=4, num_pages=32,
                  max_model_len=64)
    s.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0)))
    s.update(s.schedule(), [8])                      # prefill: one output token
    out = s.schedule({"a": [9, 10, 11, 12, 13]})
    assert out.verify and out.rows[0].token_ids == (8, 9, 10)   # 3 more tokens at most
    s.commit(out)
    req = s.get("a")
    assert req.num_computed_tokens == 4 and req.num_pending == 0
    assert not s.push_token(req, 9, fed=True)        # the proposal held
    assert not s.push_token(req, 4, fed=False)       # the correction
    assert req.output_token_ids == [8, 9, 4] and req.num_computed_tokens == 5
    assert req.num_uncomputed_tokens == 1
    assert s.push_token(req, 7, fed=False)           # the 4th token: max_tokens
    assert req.finish_reason == "length" and s.allocator.num_used == 0


def test_config_and_flags():
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ConfigError, match="speculative_method"):
        EngineConfig(num_speculative_tokens=2, speculative_method="medusa")
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="exceeds max_num_batched_tokens"):
        EngineConfig(num_speculative_tokens=7, max_num_batched_tokens=32)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(
        ["--num-speculative-tokens", "4", "--prompt-lookup-max", "5",
         "--speculative-disable-batch-size", "4"]))
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.speculative_rows) == (4, 5, 4)
    assert engine_config_from_args(p.parse_args([])).speculative_rows == 0


def test_the_cli_refuses_a_bad_speculative_config(capsys):
    from jaxinfer.cli import main
    assert main(["generate", "hi", "--model", "tiny", "--num-speculative-tokens", "2",
                 "--speculative-method", "draft"]) == 2
    assert "needs speculative_model" in capsys.readouterr().err
