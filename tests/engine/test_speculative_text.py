"""Speculative decoding on the embedded SmolLM2 through LLM.generate: greedy answers (stop
strings, chat) identical to a run without it with each proposer (prompt lookup,
self-speculation, a draft model), and prompt lookup keeping proposals on a prompt that asks
to quote a given text."""
import pytest

from jaxinfer import LLM, SamplingParams

ENGINE = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=64)
TEXT = ("The Amazon rainforest covers much of the Amazon basin of South America. This basin "
        "encompasses seven million square kilometers, of which five and a half million square "
        "kilometers are covered by the rainforest.")
PROMPTS = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}],
           [{"role": "user", "content": f"Summarise in one sentence:\n\n{TEXT}"}],
           "The capital of France is",
           [{"role": "user", "content": "Write a short poem about the sea."}]]


@pytest.fixture(scope="module")
def plain():
    return LLM("smollm2", **ENGINE)


@pytest.fixture(scope="module")
def spec():
    return LLM("smollm2", num_speculative_tokens=3, **ENGINE)


def test_greedy_answers_are_identical(plain, spec):
    params = [SamplingParams(temperature=0.0, max_tokens=48),
              SamplingParams(temperature=0.0, max_tokens=48, stop=["million square"]),
              SamplingParams(temperature=0.0, max_tokens=9, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=40, stop=["endless"],
                             include_stop_str_in_output=True)]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert want[1].text.endswith("five and a half ") and want[3].text.endswith("endless")
    assert [list(d) for d in got[2].logprobs] == [list(d) for d in want[2].logprobs]
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_prompt_lookup_keeps_proposals_when_quoting(spec):
    before = spec.engine.spec_stats.as_dict()
    out = spec.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40),
                        use_tqdm=False)[0]
    assert out.text.startswith("The Amazon rainforest covers much of the Amazon basin")
    now = spec.engine.spec_stats.as_dict()
    drafts = now["num_drafts"] - before["num_drafts"]
    accepted = now["num_accepted_tokens"] - before["num_accepted_tokens"]
    # A quoted text is the proposer's best case: most proposals hold.
    assert drafts > 5 and accepted / drafts > 1.5, (drafts, accepted)


def test_self_speculation_answers_are_identical(plain):
    """The model's first 22 of 30 layers draft: an early exit that was never trained for
    it, so few proposals hold; the answers are the plain run's all the same."""
    llm = LLM("smollm2", num_speculative_tokens=3, speculative_method="self",
              speculative_draft_layers=22, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    got = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_model_answers_identically(plain):
    """speculative_method "draft" loaded by name. SmolLM2 is the one real model shipped, so
    it drafts for itself: every greedy proposal holds (a check of the draft model's own KV
    pool on real weights, not a speed-up)."""
    llm = LLM("smollm2", num_speculative_tokens=3, speculative_method="draft",
              speculative_model="smollm2", **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    want = plain.generate(PROMPTS[1:3], params, use_tqdm=False)
    got = llm.generate(PROMPTS[1:3], params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 5 and stats.acceptance_rate > 0.9
