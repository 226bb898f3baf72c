"""Property-based: any bytes sent as a GenerateRequest either decode to a request the
converters accept, or are refused with InvalidRequestError naming a field (a malformed
message: "request"); never another exception."""
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.errors import InvalidRequestError
from serve import convert
from serve import jaxinfer_pb2 as pb
from serve.service import Malformed, _lenient

PARSE = _lenient(pb.GenerateRequest)


def convert_request(req):
    convert.prompt_from_proto(req)
    convert.sampling_from_proto(req.sampling)
    convert.request_id_from_proto(req)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes(data):
    req = PARSE(data)
    if isinstance(req, Malformed):
        return
    try:
        convert_request(req)
    except InvalidRequestError as e:
        assert e.field


SAMPLING = st.builds(
    pb.SamplingParams, max_tokens=st.integers(-2**63, 2**63 - 1),
    temperature=st.floats(allow_nan=True), top_p=st.floats(allow_nan=True),
    top_k=st.integers(-2**63, 2**63 - 1), min_p=st.floats(allow_nan=True),
    seed=st.integers(-2**63, 2**63 - 1), stop=st.lists(st.binary(max_size=4), max_size=2),
    stop_token_ids=st.lists(st.integers(-2**63, 2**63 - 1), max_size=2),
    logprobs=st.integers(-2**63, 2**63 - 1), ignore_eos=st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.builds(pb.GenerateRequest, text=st.binary(max_size=8)),
                 st.builds(pb.GenerateRequest, token_ids=st.builds(
                     pb.TokenIds, ids=st.lists(st.integers(-2**63, 2**63 - 1), max_size=4))),
                 st.builds(pb.GenerateRequest)),
       SAMPLING, st.text(max_size=200))
def test_any_message(req, sampling, rid):
    req.sampling.CopyFrom(sampling)
    req.request_id = rid
    req = PARSE(req.SerializeToString())
    try:
        convert_request(req)
    except InvalidRequestError as e:
        assert e.field
