"""SamplingParams' vLLM options beyond the sampler's: min_tokens (EOS and stop token ids held
back on the device until that many tokens), include_stop_str_in_output, skip_special_tokens."""
import pytest

from engine_util import run_alone, tiny_engine
from jaxinfer.engine_io import Detokenized
from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import FinishReason, SamplingParams

PROMPT = {"prompt_token_ids": [9, 31, 77, 4, 120, 55, 8]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def free():
    """The prompt's greedy answer with nothing stopping it."""
    return run_alone(tiny_engine(), PROMPT, GREEDY).token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("via", ["eos", "stop_token_ids"])
def test_min_tokens_holds_back_eos_and_stop_ids(free, via, async_scheduling):
    stop = free[1]                   # the answer's second token ends it without min_tokens
    engine = tiny_engine(async_scheduling=async_scheduling)
    kw = {"max_tokens": 10, "temperature": 0.0}
    if via == "eos":
        engine.scheduler.eos_token_ids = frozenset({stop})
    else:
        kw["stop_token_ids"] = [stop]
    short = run_alone(engine, PROMPT, SamplingParams(**kw))
    assert short.token_ids == free[:2] and short.finish_reason == FinishReason.STOP
    held = run_alone(engine, PROMPT, SamplingParams(**kw, min_tokens=6))
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:6]
    assert held.token_ids[0] == free[0]
    assert held.finish_reason == (FinishReason.STOP if held.token_ids[-1] == stop
                                  else FinishReason.LENGTH)


def test_min_tokens_is_validated():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.field == "min_tokens"
    for field in ("include_stop_str_in_output", "skip_special_tokens"):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**{field: 1})
        assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        tiny_engine().add_request(PROMPT, SamplingParams(min_tokens=1,
                                                         stop_token_ids=list(range(40))))
    assert e.value.field == "stop_token_ids"


class _Chars:
    """A tokenizer whose token i is the character chr(i); 3 is special."""
    special = {3}

    def decode(self, ids, skip_special_tokens=True):
        return "".join("<s>" if i in self.special else chr(i) for i in ids
                       if not (skip_special_tokens and i in self.special))


def _text(params, ids):
    d = Detokenized(_Chars(), [ord("x")], params, None)
    hit = False
    for i, t in enumerate(ids):
        hit = d.add(t, done=i == len(ids) - 1)[1] or hit
        if hit:
            break
    return d.text, hit


def test_stop_strings_with_and_after_min_tokens():
    ids = [ord(c) for c in "ab.cd.ef"]
    assert _text(SamplingParams(stop=["."]), ids) == ("ab", True)
    assert _text(SamplingParams(stop=["."], include_stop_str_in_output=True), ids) == (
        "ab.", True)
    assert _text(SamplingParams(stop=["."], max_tokens=16, min_tokens=4), ids) == ("ab.cd", True)
    assert _text(SamplingParams(stop=[".c", "."], include_stop_str_in_output=True),
                 ids) == ("ab.", True)


def test_skip_special_tokens():
    ids = [ord("a"), 3, ord("b")]
    assert _text(SamplingParams(), ids) == ("ab", False)
    assert _text(SamplingParams(skip_special_tokens=False), ids) == ("a<s>b", False)
