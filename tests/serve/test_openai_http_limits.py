"""The OpenAI-compatible HTTP API's limits on a real tiny-model server subprocess (no
tokenizer: token-id prompts), driven by the official `openai` client: 503 while loading,
return_token_ids, 429 on a full queue, 50 cancelled streams freeing their pages, the metrics
port serving /metrics only."""
import concurrent.futures as cf
import random
import time
import urllib.request

import numpy as np
import openai
import pytest

from http_util import call, metrics
from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.request import SamplingParams
from serve.launcher import ServerProcess

TINY_ARGS = ["--model", "tiny", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
             "--max-model-len", "2048", "--page-size", "16", "--dtype", "float32"]
MAX_WAITING = 6


def greedy(max_tokens=16, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def tiny():
    srv = ServerProcess([*TINY_ARGS, "--http-port", "0", "--no-grpc", "--max-waiting",
                         str(MAX_WAITING), "--grace-period", "60"])
    try:
        srv.wait_listening()
        srv.early = (call(srv.http_url + "/health")[0],
                     call(srv.http_url + "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}))
        srv.wait_serving(timeout=240)
        yield srv
    finally:
        srv.stop()


def tiny_client(srv, **kw):
    return openai.OpenAI(base_url=srv.http_url + "/v1", api_key="none", max_retries=0, **kw)


def test_lora_adapters_cannot_be_loaded_unless_the_server_allows_it(tiny):
    status, body = call(tiny.http_url + "/v1/load_lora_adapter",
                        {"lora_name": "a", "lora_path": "/nonexistent"})
    assert status == 404 and "--allow-runtime-lora" in body["error"]["message"]
    status, body = call(tiny.http_url + "/v1/completions",
                        {"model": "a", "prompt": [5, 6], "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert [m["id"] for m in call(tiny.http_url + "/v1/models")[1]["data"]] == ["tiny"]


def test_503_while_loading(tiny):
    health, (status, body) = tiny.early
    assert health == 503
    assert status == 503 and body["error"]["code"] == "service_unavailable"
    assert tiny.port is None and "grpc port off" in tiny.log()


def test_token_ids_equal_llm_generate(tiny):
    """A model without a tokenizer answers in token ids (return_token_ids), streamed or not."""
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=2048, page_size=16,
                  dtype="float32")
    ps = [[5, 6, 7], [9, 10, 11, 12, 13]]
    want = LLM("tiny", engine_config=EngineConfig(**engine)).generate(
        [{"prompt_token_ids": p} for p in ps], greedy(10), use_tqdm=False)
    with tiny_client(tiny, timeout=60) as c:
        plain = c.completions.create(model="tiny", prompt=ps, max_tokens=10, temperature=0,
                                     extra_body={"return_token_ids": True})
        assert [ch.token_ids for ch in plain.choices] == [w.token_ids for w in want]
        got = [[], []]
        for chunk in c.completions.create(model="tiny", prompt=ps, max_tokens=10,
                                          temperature=0, stream=True,
                                          extra_body={"return_token_ids": True}):
            for ch in chunk.choices:
                got[ch.index] += ch.token_ids
        assert got == [w.token_ids for w in want]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        assert e.value.body["param"] == "messages" and "tokenizer" in e.value.body["message"]


def test_queue_full_is_429(tiny):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, 20).tolist() for _ in range(40)]

    def run(p):
        with tiny_client(tiny, timeout=120) as c:
            try:
                return c.completions.create(model="tiny", prompt=p, max_tokens=30,
                                            temperature=0).choices[0].finish_reason
            except openai.RateLimitError as e:
                assert e.body["code"] == "rate_limit_exceeded"
                return 429

    with cf.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(run, prompts))
    assert 429 in results and results.count("length") >= 4


def _stream_and_cancel(srv, prompt, rng) -> bool:
    """Stream a long answer, then stop reading after a random number of chunks (True), or
    time out before the first (False: the server may not have taken the request yet). A full
    queue is retried. (The tiny model has no tokenizer, so no text: logprobs make each token
    a chunk.)"""
    for _ in range(200):
        timeout = 60 if rng.random() < 0.8 else rng.uniform(0.02, 0.3)
        n = int(rng.integers(1, 6))
        with tiny_client(srv, timeout=timeout) as c:
            try:
                with c.completions.create(model="tiny", prompt=prompt, max_tokens=LONG,
                                          temperature=0, stream=True, logprobs=0,
                                          extra_body={"ignore_eos": True}) as stream:
                    for i, chunk in enumerate(stream):
                        assert not (chunk.choices and chunk.choices[0].finish_reason)
                        if i + 1 >= n:
                            return True
            except openai.RateLimitError:
                time.sleep(0.05)
            except openai.APITimeoutError:
                return False
    raise AssertionError("the queue stayed full")


LONG = 1900   # tokens a stream would run to: ~25,000 steps for 50 of them, were none aborted


def test_cancelled_streams_free_their_pages(tiny):
    rng = np.random.default_rng(random.randrange(1 << 30))
    prompts = [rng.integers(3, 512, rng.integers(3, 40)).tolist() for _ in range(50)]
    seeds = rng.integers(0, 1 << 30, 50)
    before = metrics(tiny.http_url + "/metrics")
    with cf.ThreadPoolExecutor(8) as pool:
        read = list(pool.map(lambda a: _stream_and_cancel(tiny, a[0],
                                                          np.random.default_rng(a[1])),
                             zip(prompts, seeds)))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(tiny.http_url + "/metrics")
        if m["jaxinfer_kv_pages_used"] == 0 and m["jaxinfer_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert m["jaxinfer_kv_pages_used"] == 0 and m["jaxinfer_requests_running"] == 0
    gone = "jaxinfer_requests_total{disconnected}"
    # every stream read from counts as disconnected; one that timed out may not have arrived
    assert sum(read) <= m.get(gone, 0) - before.get(gone, 0) <= 50, sum(read)
    assert m["jaxinfer_output_tokens_total"] - before["jaxinfer_output_tokens_total"] < 50 * LONG / 4
    # Still serving after all that.
    with tiny_client(tiny, timeout=60) as c:
        assert c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3,
                                    temperature=0).usage.completion_tokens == 3


def test_metrics_port_serves_only_metrics(tiny):
    base = f"http://127.0.0.1:{tiny.metrics_port}"
    assert "jaxinfer_requests_running" in urllib.request.urlopen(base + "/metrics",
                                                                 timeout=10).read().decode()
    for path in ("/", "/v1/models", "/metricsx"):
        assert call(base + path, token=None)[0] == 404
