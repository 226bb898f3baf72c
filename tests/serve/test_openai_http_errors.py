"""The OpenAI-compatible HTTP API's answers to bad requests, on a real SmolLM2 server
subprocess driven by the official `openai` client: every bad field is named (400, or 404 for
an unknown model), malformed and oversized bodies are refused, and a wrong or missing token
gets 401 everywhere but the health probe. Nothing here generates: the server skips warm-up."""
import functools
import http.client
import json
import secrets

import openai
import pytest

from http_util import call as _call, smol_client, smol_server

TOKEN = secrets.token_hex(16)
MAX_BODY = 8 << 20


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with smol_server(tmp_path_factory.mktemp("auth"), TOKEN, "--max-message-bytes",
                     str(MAX_BODY), "--warmup", "off") as srv:
        yield srv


def test_the_server_skips_its_warm_up_when_told_to(smol):
    log = smol.log()
    assert "warm-up off (--warmup off)" in log and "compiled" not in log, log[-2000:]


@pytest.fixture
def client(smol):
    with smol_client(smol, TOKEN) as c:
        yield c


call = functools.partial(_call, token=TOKEN)


@pytest.mark.parametrize("kw, status, param", [
    (dict(temperature=-1), 400, "temperature"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(n=0), 400, "n"),
    (dict(logprobs=21), 400, "logprobs"),
    (dict(extra_body={"prompt_logprobs": 21}), 400, "prompt_logprobs"),
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), 400, "prompt_logprobs"),
    (dict(presence_penalty=3), 400, "presence_penalty"),
    (dict(seed=-1), 400, "seed"),
    (dict(logit_bias={"5": 1}), 400, "logit_bias"),
    (dict(extra_body={"bogus": 1}), 400, "bogus"),
    (dict(extra_body={"top_k": "many"}), 400, "top_k"),
    (dict(extra_body={"stop": 5}), 400, "stop"),
    (dict(extra_body={"priority": "high"}), 400, "priority"),
    (dict(prompt=[1, 2, 1 << 20]), 400, "prompt_token_ids"),
    (dict(prompt="word " * 300), 400, "prompt_token_ids"),
    (dict(prompt=""), 400, "prompt"),
    (dict(model="gpt-4"), 404, "model"),
])
def test_completion_errors_name_the_field(client, kw, status, param):
    kw = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**kw)
    assert e.value.status_code == status
    assert e.value.body["param"] == param and param in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw, param", [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user"}]), "messages[0].content"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=30), "top_logprobs"),
    (dict(max_completion_tokens=-3), "max_completion_tokens"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}),
     "response_format.json_schema.schema"),
    (dict(extra_body={"structured_outputs": {"regex": "(a"}}), "structured_outputs.regex"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {
        "choice": ["a"]}}), "structured_outputs"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_chat_errors_name_the_field(client, kw, param):
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert e.value.body["param"] == param


def test_malformed_and_oversized_bodies(smol):
    url = smol.http_url + "/v1/completions"
    status, body = call(url, b"{not json")
    assert status == 400 and body["error"]["param"] == "body"
    status, body = call(url, ["a list"])
    assert status == 400 and body["error"]["param"] == "body"
    # A body declared over the limit is refused before it is read.
    conn = http.client.HTTPConnection("127.0.0.1", smol.http_port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for k, v in (("content-type", "application/json"), ("authorization", f"Bearer {TOKEN}"),
                 ("content-length", str(MAX_BODY + 1))):
        conn.putheader(k, v)
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    status, body = call(smol.http_url + "/v1/nothing", {})
    assert status == 404 and "error" in body
    status, body = call(url, method="GET")
    assert status == 405 and "error" in body


def test_auth(smol):
    with openai.OpenAI(base_url=smol.http_url + "/v1", api_key="wrong", max_retries=0) as c, \
            pytest.raises(openai.AuthenticationError) as e:
        c.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path, body in (("/v1/models", None), ("/v1/completions", {"prompt": "x"}),
                       ("/tokenize", {"prompt": "x"})):
        status, err = call(smol.http_url + path, body, token=None)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
    assert call(smol.http_url + "/health", token=None)[0] == 200   # probes need no token
    for url in (smol.http_url + "/metrics", f"http://127.0.0.1:{smol.metrics_port}/metrics"):
        status, err = call(url, token=None)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, text = call(url)
        assert status == 200 and "jaxinfer_kv_pages_used" in text
