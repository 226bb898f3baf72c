"""Prompt logprobs (SamplingParams.prompt_logprobs) against a dense float64 forward, under
chunked prefill, async scheduling, batching, prefix caching and n > 1."""
import numpy as np
import pytest

from dense_reference import dense_logits, random_flat
from engine_util import TINY, count_scheduled_tokens, random_prompts, run_alone, run_staggered, tiny_engine
from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import SamplingParams
from jaxinfer.runner import CompileCounter

FLAT = random_flat(TINY, seed=11, std=0.08)    # engine_util.tiny_model's weights


def reference(ids):
    """Per prompt token p >= 1: (its logprob given ids[:p], its rank, the top ids there)."""
    logits = dense_logits(TINY, FLAT, ids)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    out = []
    for p in range(1, len(ids)):
        row = logp[p - 1]
        out.append((row[ids[p]], int((row >= row[ids[p]]).sum()), np.argsort(-row)))
    return out


def check(entries, ids, n):
    assert len(entries) == len(ids) and entries[0] is None
    for p, (d, (lp, rank, order)) in enumerate(zip(entries[1:], reference(ids)), start=1):
        assert ids[p] in d, f"prompt token {p} missing from its dict"
        assert d[ids[p]].logprob == pytest.approx(lp, abs=2e-4)
        assert d[ids[p]].rank == rank
        top = sorted((v.rank, t) for t, v in d.items() if v.rank <= n)
        assert [t for _, t in top] == order[:n].tolist()
        assert len(d) in (n, n + 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_dense_forward_chunked_and_batched(async_scheduling):
    engine = tiny_engine(async_scheduling=async_scheduling, max_num_batched_tokens=32)
    prompts = random_prompts(4, lo=2, hi=90, seed=21)     # up to 3 chunks of 32
    asked = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=n, ignore_eos=True)
             for n in (0, 3, 5, 20)]
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = run_staggered(engine, prompts + prompts[:2], asked + [plain] * 2, [0, 1, 1, 3, 0, 2])
    for o, p, n in zip(outs, prompts, (0, 3, 5, 20)):
        check(o.prompt_logprobs, p["prompt_token_ids"], n)
        assert o.outputs[0].logprobs is None
    assert outs[4].prompt_logprobs is None
    # Asking for them changes nothing about the generated tokens.
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in outs[4:]]


def test_prompt_logprobs_skip_the_prefix_cache_but_fill_it():
    engine = tiny_engine(enable_prefix_caching=True)
    prompt = random_prompts(1, lo=40, hi=41, seed=5)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    run_alone(engine, prompt, plain)                   # caches its full pages
    fed = count_scheduled_tokens(engine)
    out = run_alone(engine, prompt, asked)
    check(out.prompt_logprobs, prompt["prompt_token_ids"], 2)
    assert sum(fed) == 40 + 1, "took prefix-cache hits: some prompt tokens were not fed"
    del fed[:]
    again = run_alone(engine, prompt, plain)
    assert again.token_ids == out.token_ids
    assert sum(fed) < 40 - 8, "the cache lost the prompt's pages"


def test_prompt_logprobs_with_n_and_one_token_prompts():
    engine = tiny_engine()
    ids = random_prompts(1, lo=12, hi=13, seed=8)[0]["prompt_token_ids"]
    out = run_alone(engine, {"prompt_token_ids": ids},
                    SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4,
                                   prompt_logprobs=1))
    check(out.prompt_logprobs, ids, 1)
    assert len(out.outputs) == 3
    one = run_alone(engine, {"prompt_token_ids": ids[:1]},
                    SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4))
    assert one.prompt_logprobs == [None]


def test_prompt_logprobs_validation():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(Exception) as e:
            SamplingParams(prompt_logprobs=bad)
        assert "prompt_logprobs" in str(e.value)
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=21)


def test_prompt_variant_compiles_ahead():
    engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=32)
    engine.warmup(progress=False, variants=("plain", "full", "prompt"))
    before = CompileCounter.count()
    prompts = random_prompts(6, lo=2, hi=70, seed=3)
    params = [SamplingParams(temperature=0.7, max_tokens=4, prompt_logprobs=i % 3,
                             ignore_eos=True) for i in range(6)]
    outs = run_staggered(engine, prompts, params, [0, 0, 1, 2, 4, 4])
    assert CompileCounter.count() == before
    for o, p, sp in zip(outs, prompts, params):
        check(o.prompt_logprobs, p["prompt_token_ids"], sp.prompt_logprobs)
