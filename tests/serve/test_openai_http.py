"""The OpenAI-compatible HTTP API against a real SmolLM2 server subprocess, driven by the
official `openai` client: text, chat, logprobs, gRPC beside HTTP; SIGTERM drains streams
(last: it ends the server). Bad requests and auth: test_openai_http_errors; the tiny model's
limits: test_openai_http_limits."""
import concurrent.futures as cf
import functools
import json
import re
import secrets
import threading
import time

import numpy as np
import openai
import pytest

from http_util import call as _call, smol_client, smol_server
from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.request import SamplingParams
from serve.client import Client

SMOL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, dtype="float32")
TOKEN = secrets.token_hex(16)
MAX_BODY = 8 << 20
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHATS = [[{"role": "user", "content": "Name three colors."}],
         [{"role": "system", "content": "You answer briefly."},
          {"role": "user", "content": "What is 2 + 2?"}]]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with smol_server(tmp_path_factory.mktemp("auth"), TOKEN, "--max-message-bytes",
                     str(MAX_BODY), "--grace-period", "120") as srv:
        yield srv


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", engine_config=EngineConfig(**SMOL_ENGINE))


@pytest.fixture
def client(smol):
    with smol_client(smol, TOKEN) as c:
        yield c


call = functools.partial(_call, token=TOKEN)


def greedy(max_tokens=16, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_completions_stream_equals_plain_and_llm_generate(client, llm):
    want = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    plain = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=16,
                                      temperature=0)
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-")
    assert [c.index for c in plain.choices] == [0, 1]
    assert [c.text for c in plain.choices] == [w.text for w in want]
    assert plain.choices[0].text.startswith(" Paris.")
    assert [c.finish_reason for c in plain.choices] == [str(w.finish_reason) for w in want]
    assert plain.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert plain.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    texts, finish, usage = ["", ""], [None, None], []
    for chunk in client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=16,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage.append(chunk.usage)
        for c in chunk.choices:
            assert finish[c.index] is None     # nothing after a choice's finish
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason
    assert texts == [w.text for w in want]
    assert finish == [str(w.finish_reason) for w in want]
    assert len(usage) == 1 and usage[0] == plain.usage


def test_chat_stream_equals_plain_and_llm_generate(client, llm):
    want = llm.generate(CHATS, greedy(24), use_tqdm=False)
    for messages, w in zip(CHATS, want):
        plain = client.chat.completions.create(model="smollm2", messages=messages,
                                               max_completion_tokens=24, temperature=0)
        assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
        msg = plain.choices[0].message
        assert (msg.role, msg.content) == ("assistant", w.text)
        assert plain.choices[0].finish_reason == str(w.finish_reason)
        assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (
            len(w.prompt_token_ids), len(w.token_ids))

        chunks = list(client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == w.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == str(
            w.finish_reason)
        assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
        assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_stop_strings(client, llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    [want] = llm.generate({"prompt_token_ids": ids}, greedy(16, stop=("ris",)), use_tqdm=False)
    got = client.completions.create(model="smollm2", prompt=ids, max_tokens=16, temperature=0,
                                    stop="ris", extra_body={"priority": -3})
    assert got.choices[0].text == want.text == " Pa"
    assert got.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=[ids], max_tokens=16, temperature=0, stop=["ris", "zzz"],
        stream=True))
    assert streamed == want.text


def test_logprobs_equal_llm_generate(client, llm):
    [want] = llm.generate(PROMPTS[:1], greedy(6, logprobs=3), use_tqdm=False)
    want_lp = [d[t].logprob for d, t in zip(want.logprobs, want.token_ids)]
    got = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=6,
                                    temperature=0, logprobs=3).choices[0].logprobs
    np.testing.assert_allclose(got.token_logprobs, want_lp, rtol=1e-4, atol=1e-4)
    assert "".join(got.tokens) == want.text
    assert got.text_offset == [len("".join(got.tokens[:i])) for i in range(len(got.tokens))]
    assert all(len(top) <= 3 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(got.top_logprobs, got.token_logprobs))

    [wchat] = llm.generate([CHATS[1]], greedy(6, logprobs=2), use_tqdm=False)
    chat = client.chat.completions.create(model="smollm2", messages=CHATS[1], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    np.testing.assert_allclose([c.logprob for c in content],
                               [d[t].logprob for d, t in zip(wchat.logprobs, wchat.token_ids)],
                               rtol=1e-4, atol=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    streamed = [lp.logprob for ch in client.chat.completions.create(
        model="smollm2", messages=CHATS[1], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if ch.choices and ch.choices[0].logprobs
        for lp in ch.choices[0].logprobs.content]
    np.testing.assert_allclose(streamed, [c.logprob for c in content], rtol=1e-6)

    # vLLM's prompt_logprobs: per choice in completions, at the top of a chat response.
    [wp] = llm.generate(PROMPTS[:1], greedy(2, prompt_logprobs=2), use_tqdm=False)
    got = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=2, n=2,
                                    temperature=0, extra_body={"prompt_logprobs": 2})
    for choice in got.choices:
        entries = choice.prompt_logprobs
        assert len(entries) == len(wp.prompt_token_ids) and entries[0] is None
        for e, w in zip(entries[1:], wp.prompt_logprobs[1:]):
            assert {int(t): (v["rank"], v["decoded_token"]) for t, v in e.items()} == {
                t: (lp.rank, lp.decoded_token) for t, lp in w.items()}
            np.testing.assert_allclose([v["logprob"] for v in e.values()],
                                       [lp.logprob for lp in w.values()], rtol=1e-4, atol=1e-4)
    chat = client.chat.completions.create(model="smollm2", messages=CHATS[1], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    [wc] = llm.generate([CHATS[1]], greedy(2, prompt_logprobs=0), use_tqdm=False)
    assert [None if e is None else list(e) for e in chat.prompt_logprobs] == [
        None if e is None else [str(t) for t in e] for e in wc.prompt_logprobs]


def test_vllm_sampling_extras_equal_llm_generate(client, llm):
    """min_tokens, include_stop_str_in_output and skip_special_tokens (vLLM's extra body
    fields) reach the engine: the answers equal LLM.generate's with the same params."""
    [free] = llm.generate(PROMPTS[0], greedy(8, ignore_eos=True), use_tqdm=False)
    cases = [dict(stop_token_ids=[free.token_ids[1]], min_tokens=5),
             dict(stop=["ris"], include_stop_str_in_output=True),
             dict(skip_special_tokens=False)]
    wants = []
    for extra in cases:
        [want] = llm.generate(PROMPTS[0], greedy(8, **extra), use_tqdm=False)
        got = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=8,
                                        temperature=0, extra_body=extra).choices[0]
        assert (got.text, got.finish_reason) == (want.text, str(want.finish_reason)), extra
        wants.append(want)
    held, stopped, _ = wants
    assert len(held.token_ids) >= 5 and free.token_ids[1] not in held.token_ids[:5]
    assert stopped.text == " Paris" and stopped.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="smollm2", prompt=PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.95,
              seed=7, extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == a


def test_n_choices_equal_llm_generate_plain_and_streamed(client, llm):
    """n > 1: choice p * n + i is prompt p's completion i, equal to LLM.generate's (seeded);
    streamed, each choice's deltas join to it; usage counts each prompt once."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    want = [[c.text for c in o.outputs] for o in outs]
    kw = dict(model="smollm2", prompt=PROMPTS, max_tokens=8, temperature=0.9, seed=11, n=3)
    got = client.completions.create(**kw)
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == want[0] + want[1]
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for o in outs
                                              for c in o.outputs)
    streamed, finished = {}, {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert [streamed[i] for i in range(6)] == want[0] + want[1] and len(finished) == 6
    chat = dict(model="smollm2", messages=CHATS[0], max_tokens=10, temperature=0.9, seed=2, n=2)
    plain = client.chat.completions.create(**chat)
    parts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**chat, stream=True):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    assert [parts[0], parts[1]] == [c.message.content for c in plain.choices]
    assert plain.choices[0].message.content != plain.choices[1].message.content


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"]}


def test_structured_output_through_response_format_and_structured_outputs(client):
    """response_format (json_schema, json_object) and vLLM's structured_outputs extra field,
    plain and streamed: every answer parses and matches."""
    import jsonschema

    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=80, temperature=0.8, seed=3, n=3, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    obj = client.chat.completions.create(
        model="smollm2", messages=CHATS[0], max_tokens=80, temperature=0,
        response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(obj), dict)
    choices = ["Paris", "Lyon", "Nice"]
    pick = client.completions.create(model="smollm2", prompt="The best city is", max_tokens=8,
                                     temperature=0, extra_body={"structured_outputs": {
                                         "choice": choices}}).choices[0]
    assert pick.text in choices and pick.finish_reason == "stop"
    chunks = client.completions.create(model="smollm2", prompt="Call me at", max_tokens=20,
                                       temperature=0.5, seed=1, stream=True, extra_body={
                                           "structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"\d{3}-\d{4}", text), text


def test_huge_prompt_is_refused_without_stalling_streams(client, smol):
    """A 4 MB prompt is refused at once (it cannot fit in max_model_len tokens, so it is not
    tokenized), and a concurrent stream's tokens keep their pace meanwhile."""
    big = {"model": "smollm2", "prompt": "word " * 800_000, "max_tokens": 4}
    refused = {}

    def send():
        refused["t0"] = time.monotonic()
        refused["status"], refused["body"] = call(smol.http_url + "/v1/completions", big)
        refused["t1"] = time.monotonic()

    times, sender = [], threading.Thread(target=send)
    for i, chunk in enumerate(client.completions.create(
            model="smollm2", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})):
        times.append(time.monotonic())
        if i == 8:
            sender.start()
    sender.join(60)
    assert refused["status"] == 400 and refused["body"]["error"]["param"] == "prompt"
    assert "characters" in refused["body"]["error"]["message"]
    assert refused["t1"] - refused["t0"] < 2.0
    gaps = np.diff(times)
    during = [b - a for a, b in zip(times, times[1:])
              if b >= refused["t0"] and a <= refused["t1"]]
    # Tokenizing 4 MB would hold the GIL ~1.5 s; steps on a loaded CPU vary by ~+-30%.
    assert during and max(during) <= 1.5 * np.median(gaps) + 0.1, (during, np.median(gaps))


def test_models_tokenize_detokenize(client, smol, llm):
    [card] = client.models.list().data
    assert (card.id, card.owned_by) == ("smollm2", "jaxinfer")
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    status, body = call(smol.http_url + "/tokenize", {"model": "smollm2", "prompt": PROMPTS[0]})
    assert status == 200 and body["tokens"] == llm.tokenizer.encode(PROMPTS[0])
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    status, chat = call(smol.http_url + "/tokenize", {"messages": CHATS[0]})
    assert status == 200 and chat["tokens"] == llm.tokenizer.encode_chat(CHATS[0])
    status, back = call(smol.http_url + "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPTS[0]
    status, err = call(smol.http_url + "/detokenize", {"tokens": [-1]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = call(smol.http_url + "/tokenize", {"prompt": "a", "messages": CHATS[0]})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_grpc_and_http_share_the_engine(client, smol):
    """Both front ends at once, on one engine: the same greedy answer from each."""
    with Client(smol.target, token=TOKEN) as g, cf.ThreadPoolExecutor(4) as pool:
        grpc_runs = [pool.submit(g.complete, PROMPTS[0], {"max_tokens": 8, "temperature": 0.0},
                                 timeout=120) for _ in range(2)]
        http_runs = [pool.submit(client.completions.create, model="smollm2", prompt=PROMPTS[0],
                                 max_tokens=8, temperature=0) for _ in range(2)]
        texts = {f.result().text for f in grpc_runs} | {
            f.result().choices[0].text for f in http_runs}
    assert len(texts) == 1 and texts.pop().startswith(" Paris.")


def test_grpc_takes_structured_outputs_n_and_the_vllm_extras(smol, llm):
    """The gRPC service's SamplingParams carry structured_outputs, n, min_tokens,
    include_stop_str_in_output and skip_special_tokens: answers equal LLM.generate's."""
    import grpc
    import jsonschema

    [free] = llm.generate(PROMPTS[0], greedy(8, ignore_eos=True), use_tqdm=False)
    cases = [dict(stop_token_ids=[free.token_ids[1]], min_tokens=5),
             dict(stop=["ris"], include_stop_str_in_output=True),
             dict(skip_special_tokens=False),
             dict(structured_outputs={"choice": ["Lyon", "Nice"]}),
             dict(structured_outputs={"regex": "[0-9]+", "any_whitespace": True})]
    wants = llm.generate([PROMPTS[0]] * len(cases), [greedy(8, **extra) for extra in cases],
                         use_tqdm=False)
    with Client(smol.target, token=TOKEN) as g, cf.ThreadPoolExecutor(len(cases)) as pool:
        runs = [pool.submit(g.complete, PROMPTS[0], greedy(8, **extra), timeout=120)
                for extra in cases]
        for extra, want, run in zip(cases, wants, runs):
            got = run.result()
            assert (got.text, got.token_ids) == (want.text, want.token_ids), extra
        sampled = g.complete("Describe a person.", SamplingParams(
            max_tokens=80, temperature=0.8, seed=4, structured_outputs={"json": PERSON}),
            timeout=120)
        jsonschema.validate(json.loads(sampled.text), PERSON)
        # n > 1: the completions come by index, equal to LLM.generate's (seeded).
        params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3)
        [want_n] = llm.generate(PROMPTS[0], params, use_tqdm=False)
        got_n = g.complete(PROMPTS[0], params, timeout=120)
        assert [c.token_ids for c in got_n.completions] == [
            c.token_ids for c in want_n.outputs]
        assert [c.text for c in got_n.completions] == [c.text for c in want_n.outputs]
        assert [c.finish_reason for c in got_n.completions] == [
            c.finish_reason for c in want_n.outputs]
        assert got_n.usage.completion_tokens == sum(len(c.token_ids) for c in want_n.outputs)
        with pytest.raises(grpc.RpcError) as e:
            g.complete(PROMPTS[0], {"structured_outputs": {"regex": "(a"}}, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.regex" in e.value.details()


def test_prompts_not_logged(smol):
    log = smol.log()
    assert "request cmpl-" in log and "(prompt not logged)" in log
    assert PROMPTS[0] not in log and "Name three colors" not in log


def test_sigterm_drains_streams(smol):
    """Last of the SmolLM2 tests: it ends that server. Streams in flight at SIGTERM finish;
    new requests get 503 meanwhile; the process exits 0."""
    results, started = {}, threading.Barrier(4)

    def stream(i):
        with openai.OpenAI(base_url=smol.http_url + "/v1", api_key=TOKEN, max_retries=0,
                           timeout=120) as c:
            text = c.completions.create(model="smollm2", prompt=PROMPTS[i % 2], max_tokens=48,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
            chunks = []
            for chunk in text:
                if not chunks:
                    started.wait(timeout=60)
                chunks.append(chunk)
            results[i] = [c.choices[0].finish_reason for c in chunks if c.choices]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    smol.terminate()
    time.sleep(0.3)
    status, body = call(smol.http_url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert call(smol.http_url + "/health")[0] == 503
    for t in threads:
        t.join(120)
    assert [results[i][-1] for i in range(3)] == ["length"] * 3
    assert smol.proc.wait(60) == 0
    assert "draining: 3 requests in flight" in smol.log()
