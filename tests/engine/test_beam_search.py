"""Beam search (LLM.beam_search, jaxinfer.beam_search): on the tiny twin it equals a plain
numpy beam search over the dense reference's logits, token for token; beams share their
prefix's pages (few tokens computed per round); bad params are named."""
import numpy as np
import pytest

from dense_reference import dense_logits, random_flat
from engine_util import TINY, count_scheduled_tokens, tiny_engine
from jaxinfer.beam_search import BeamSearchParams, beam_search
from jaxinfer.errors import InvalidRequestError

FLAT = random_flat(TINY, seed=11, std=0.08)   # tiny_engine's weights
PROMPTS = [list(range(9, 9 + 13)), [5, 77, 31, 8, 100, 64]]


def reference(prompt, width, max_tokens, length_penalty=1.0, ignore_eos=False,
              eos=frozenset(TINY.eos_token_ids)):
    """Beam search in numpy: candidates are each beam's 2 x width likeliest next tokens."""

    def score(beam):
        tokens, cum = beam
        n = len(tokens) - (tokens[-1] in eos)
        return cum / n ** length_penalty

    beams, finished = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            logits = dense_logits(TINY, FLAT, tokens)[-1]
            logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            for t in np.argsort(-logp, kind="stable")[:2 * width]:
                candidates.append((tokens + [int(t)], cum + float(logp[t])))
        ended = [c for c in candidates if not ignore_eos and c[0][-1] in eos]
        finished += ended
        beams = sorted([c for c in candidates if c not in ended], key=score,
                       reverse=True)[:width]
    return sorted(finished + beams, key=score, reverse=True)[:width]


# An EOS id the searches meet early (the second greedy token of the first prompt), so that
# beams finish at different lengths; a length penalty of 8 ranks the longer ones first.
EARLY_EOS = frozenset({reference(PROMPTS[0], 1, 2, ignore_eos=True)[0][0][-1]})


@pytest.mark.parametrize("width,max_tokens,length_penalty,eos", [
    (1, 5, 1.0, None), (3, 6, 1.0, None), (3, 6, 1.0, EARLY_EOS), (4, 5, 0.5, EARLY_EOS),
    (4, 5, 8.0, EARLY_EOS)])
def test_equals_a_numpy_beam_search(width, max_tokens, length_penalty, eos):
    engine = tiny_engine()
    eos = eos or frozenset(TINY.eos_token_ids)
    engine.scheduler.eos_token_ids = eos
    got = beam_search(engine, [{"prompt_token_ids": p} for p in PROMPTS],
                      BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                       length_penalty=length_penalty))
    for prompt, out in zip(PROMPTS, got):
        want = reference(prompt, width, max_tokens, length_penalty, eos=eos)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(
            [w[1] for w in want], rel=1e-4, abs=1e-4)
        for s in out.sequences:
            assert len(s.logprobs) == len(s.tokens) - len(prompt)
            assert s.finish_reason == ("stop" if s.tokens[-1] in eos else "length")
    if eos == EARLY_EOS:     # early ends win at penalty <= 1, lose to longer beams at 8
        lengths = {len(s.tokens) for s in got[0].sequences}
        assert len(lengths) > 1 if length_penalty <= 1 else lengths == {len(PROMPTS[0]) + 5}
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_usable and not engine.scheduler.requests


def test_width_one_is_greedy():
    engine = tiny_engine()
    [out] = beam_search(engine, [{"prompt_token_ids": PROMPTS[0]}],
                        BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    from jaxinfer.request import SamplingParams
    engine.add_request({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    [greedy] = engine.run_until_done(use_tqdm=False).values()
    assert out.sequences[0].tokens[len(PROMPTS[0]):] == greedy.token_ids


def test_beams_share_the_prefix_pages():
    engine = tiny_engine()
    fed = count_scheduled_tokens(engine)
    prompt = list(range(9, 9 + 33))
    beam_search(engine, [{"prompt_token_ids": prompt}],
                BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    page = engine.config.page_size
    # The prompt once; afterwards each beam computes at most its last page's tokens a round.
    assert sum(fed) <= len(prompt) + 8 * 3 * page
    assert sum(fed) < 8 * 3 * len(prompt)


def test_params_are_validated():
    for kw, field in [({"beam_width": 0, "max_tokens": 4}, "beam_width"),
                      ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
                      ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                      ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")},
                       "length_penalty")]:
        with pytest.raises(InvalidRequestError) as e:
            BeamSearchParams(**kw)
        assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        beam_search(tiny_engine(), [{"prompt_token_ids": []}],
                    BeamSearchParams(beam_width=2, max_tokens=2))
    assert e.value.field == "prompt_token_ids"


def test_beams_stop_at_the_context_length():
    engine = tiny_engine(max_model_len=32)
    prompt = list(range(3, 3 + 28))
    [out] = beam_search(engine, [{"prompt_token_ids": prompt}],
                        BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert [len(s.tokens) for s in out.sequences] == [32, 32]
    assert {s.finish_reason for s in out.sequences} == {"length"}
