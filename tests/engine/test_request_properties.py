"""Property-based: whatever a caller passes, SamplingParams and the OpenAI request parser
either accept it (and what they built holds its invariants) or raise InvalidRequestError
naming a field; never another exception."""
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer import openai_protocol as oai
from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import MAX_LOGPROBS, SamplingParams

FIELDS = SamplingParams.fields()
ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6)
# Values near the valid ones, so that many draws pass validation too.
NEAR = st.one_of(st.integers(-3, 40), st.floats(-3, 3), st.none(), st.booleans(),
                 st.lists(st.integers(-1, 5), max_size=3), st.text(max_size=3),
                 st.lists(st.text(max_size=3), max_size=3))
PROPS = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(st.dictionaries(st.sampled_from(FIELDS), NEAR | ANY, max_size=6))
def test_sampling_params_accept_or_name_the_field(kw):
    try:
        p = SamplingParams(**kw)
    except InvalidRequestError as e:
        # A field, or a part of one: structured_outputs.regex
        assert e.field.split(".")[0] in FIELDS and e.field in str(e)
        return
    assert isinstance(p.max_tokens, int) and p.max_tokens >= 1
    assert math.isfinite(p.temperature) and p.temperature >= 0 and 0 < p.top_p <= 1
    assert 0 <= p.top_k < 2**31 and 0 <= p.min_p <= 1 and p.repetition_penalty > 0
    assert -2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2
    assert p.seed is None or 0 <= p.seed < 2**63
    assert p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS
    assert all(isinstance(s, str) and s for s in p.stop)
    assert all(isinstance(t, int) and t >= 0 for t in p.stop_token_ids)
    hash(p)


COMPLETION_KEYS = list(oai.CompletionRequest.model_fields) + ["bogus"]
CHAT_KEYS = list(oai.ChatRequest.model_fields) + ["bogus"]
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "wizard"]),
     "content": st.text(max_size=5) | st.none() | st.integers()}), max_size=3)


@PROPS
@given(st.dictionaries(st.sampled_from(COMPLETION_KEYS), NEAR | ANY, max_size=6),
       st.text(max_size=6) | st.lists(st.integers(-1, 600), max_size=4) | ANY)
def test_completion_bodies_accept_or_name_the_field(body, prompt):
    body.setdefault("prompt", prompt)
    try:
        req = oai.parse(oai.CompletionRequest, body)
        params, prompts = oai.completion_params(req), oai.completion_prompts(req)
    except InvalidRequestError as e:
        assert e.field and e.field.split("[")[0].split(".")[0] in COMPLETION_KEYS + ["body"]
        return
    assert isinstance(params, SamplingParams) and prompts


@PROPS
@given(st.dictionaries(st.sampled_from(CHAT_KEYS), NEAR | ANY, max_size=6), MESSAGES | ANY)
def test_chat_bodies_accept_or_name_the_field(body, messages):
    body.setdefault("messages", messages)
    try:
        req = oai.parse(oai.ChatRequest, body)
        params, msgs = oai.chat_params(req, 2048), oai.chat_prompt(req)
    except InvalidRequestError as e:
        assert e.field and e.field.split("[")[0].split(".")[0] in CHAT_KEYS + ["body"]
        return
    assert params.max_tokens >= 1 and all(isinstance(m["content"], str) for m in msgs)


@PROPS
@given(ANY)
def test_any_json_body_is_parsed_or_refused(body):
    try:
        oai.parse(oai.ChatRequest, body)
    except InvalidRequestError as e:
        assert e.field
