"""The gRPC service against a real server subprocess (the tiny random model, token-id prompts,
bearer-token auth on): equality with LLM.generate, cancellation, queue limit, bad inputs,
health during startup, metrics."""
import concurrent.futures as cf
import json
import random
import secrets
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.request import SamplingParams
from serve.client import Client
from serve.launcher import ServerProcess

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=4,
              dtype="float32")
ENGINE_ARGS = ["--model", "tiny", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
               "--max-model-len", "128", "--page-size", "4", "--dtype", "float32"]
MAX_WAITING = 6
TOKEN = secrets.token_hex(16)
VOCAB = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    srv = ServerProcess([*ENGINE_ARGS, "--max-waiting", str(MAX_WAITING),
                         "--auth-token-file", str(token_file), "--http-port", "0"])
    try:
        srv.wait_listening()
        with Client(srv.target, token=TOKEN) as c:
            try:  # while the model loads
                c.complete([5, 6, 7], {"max_tokens": 2}, timeout=10)
                srv.early_code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                srv.early_code = e.code()
        srv.statuses = srv.wait_serving(timeout=240)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    with Client(server.target, token=TOKEN) as c:
        yield c


def prompts(n, seed, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _samples(server):
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def metrics(server) -> dict:
    return {s.name: s.value for s in _samples(server) if not s.labels}


def refused(server, reason: str) -> float:
    """jaxinfer_requests_refused_total for `reason`."""
    return sum(s.value for s in _samples(server) if s.name == "jaxinfer_requests_refused_total"
               and s.labels.get("reason") == reason)


def test_not_serving_until_ready(server):
    assert server.statuses[0] == "NOT_SERVING" and server.statuses[-1] == "SERVING"
    assert server.early_code == grpc.StatusCode.UNAVAILABLE


def test_model_info(client):
    info = client.model_info(timeout=10)
    assert (info.model, info.context_length, info.vocab_size) == ("tiny", 128, VOCAB)
    assert not info.has_tokenizer and info.max_waiting_requests == MAX_WAITING
    assert len(info.buckets) >= 2 and any(b.decode_only for b in info.buckets)


def test_lora_loading_is_refused_unless_the_server_allows_it(client):
    with pytest.raises(grpc.RpcError) as e:
        client.load_lora_adapter("a", "/nonexistent", timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--allow-runtime-lora" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:      # this server serves no adapters
        client.complete([5, 6], {"max_tokens": 2, "lora": "a"}, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("lora: ")
    assert list(client.model_info(timeout=10).lora_adapters) == []


def test_stream_equals_llm_generate(server):
    """Concurrent greedy and seeded streams give LLM.generate's tokens and finish reasons."""
    ps = prompts(8, seed=random.randrange(1 << 30))
    params = [SamplingParams(max_tokens=12, temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i,
                             logprobs=2, prompt_logprobs=1 if i % 4 == 0 else None)
              for i in range(len(ps))]
    llm = LLM("tiny", engine_config=EngineConfig(**ENGINE))
    want = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    with Client(server.target, token=TOKEN) as c, cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda a: c.complete(*a, timeout=60), zip(ps, params)))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == str(w.finish_reason)
        assert g.usage.prompt_tokens == len(w.prompt_token_ids)
        assert g.usage.completion_tokens == len(w.token_ids)
        if w.logprobs is not None:
            assert [lp.token_id for lp in g.logprobs] == w.token_ids
            np.testing.assert_allclose([lp.logprob for lp in g.logprobs],
                                       [d[t].logprob for d, t in zip(w.logprobs, w.token_ids)],
                                       rtol=1e-4, atol=1e-4)
            # ranks as the engine's Logprob (hot samples fall below the top); no tokenizer:
            # no decoded tokens
            assert [lp.rank for lp in g.logprobs] == [d[t].rank for d, t in
                                                      zip(w.logprobs, w.token_ids)]
            assert [sorted(a.rank for a in lp.top) for lp in g.logprobs] == [
                sorted(v.rank for v in d.values()) for d in w.logprobs]
            assert {lp.decoded_token for lp in g.logprobs} == {""}
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert [lp.token_id for lp in g.prompt_logprobs] == w.prompt_token_ids
        assert not g.prompt_logprobs[0].top and g.prompt_logprobs[0].rank == 0
        for lp, d in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert lp.rank == d[lp.token_id].rank
            assert lp.logprob == pytest.approx(d[lp.token_id].logprob, abs=1e-4)
            assert {a.token_id: a.rank for a in lp.top} == {t: v.rank for t, v in d.items()}
    assert sum(g.prompt_logprobs is not None for g in got) == 2
    assert max(lp.rank for g in got for lp in g.logprobs) > 1


def _cancel_after(target, prompt, n, rng):
    """Stream, then cancel after n responses (or by a short deadline); True if it finished.
    A full queue (aborts of this client's earlier streams may not have landed yet) is
    retried, as the status tells clients to."""
    with Client(target, token=TOKEN) as c:
        for _ in range(100):
            timeout = 60 if rng.random() < 0.8 else rng.uniform(0.02, 0.3)
            stream = c.generate(prompt, {"max_tokens": 100, "temperature": 0.0}, timeout=timeout)
            try:
                if n == 0:
                    stream.cancel()
                for i, resp in enumerate(stream):
                    if resp.finish_reason:
                        return True
                    if i + 1 >= n:
                        stream.cancel()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    time.sleep(0.05)
                    continue
                assert e.code() in (grpc.StatusCode.CANCELLED,
                                    grpc.StatusCode.DEADLINE_EXCEEDED), e
            return False
    raise AssertionError("the queue stayed full")


def _wait_idle(server, timeout=30.0) -> dict:
    deadline, m = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        m = metrics(server)
        if (m["jaxinfer_kv_pages_used"], m["jaxinfer_requests_running"],
                m["jaxinfer_requests_waiting"]) == (0, 0, 0):
            return m
        time.sleep(0.1)
    return m


def test_cancelled_streams_free_their_pages(server, client):
    rng = random.Random(secrets.randbits(32))
    ps = prompts(50, seed=rng.randrange(1 << 30))
    cuts = [rng.randrange(0, 30) for _ in ps]
    with cf.ThreadPoolExecutor(8) as pool:
        finished = list(pool.map(lambda a: _cancel_after(server.target, *a, rng), zip(ps, cuts)))
    assert not all(finished)
    m = _wait_idle(server)
    assert m["jaxinfer_kv_pages_used"] == 0 and m["jaxinfer_requests_running"] == 0
    done = client.complete(ps[0], {"max_tokens": 5, "temperature": 0.0}, timeout=30)
    assert done.finish_reason == "length" and len(done.token_ids) == 5


def _one(target, prompt):
    try:
        with Client(target, token=TOKEN) as c:
            # ignore_eos: the tiny model's greedy answer ends in EOS for ~1% of random
            # prompts (checked against the dense reference); this test is about the queue.
            done = c.complete(prompt, {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True},
                              timeout=120)
        return done.finish_reason, len(done.token_ids)
    except grpc.RpcError as e:
        return e.code(), 0


def test_flood_beyond_queue_limit(server):
    before = refused(server, "queue_full")
    ps = prompts(40, seed=secrets.randbits(30))
    with cf.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda p: _one(server.target, p), ps))
    rejected = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    accepted = [r for r in results if r[0] != grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert rejected and accepted
    assert all(r == ("length", 40) for r in accepted), results
    assert refused(server, "queue_full") - before == len(rejected)
    assert _wait_idle(server)["jaxinfer_kv_pages_used"] == 0


def test_a_call_whose_deadline_the_server_cannot_meet_is_refused_at_once(server, client):
    """The call's deadline is the request's. Once the server has timed some steps, a call
    asking for far more tokens than its deadline leaves time for is refused with
    RESOURCE_EXHAUSTED before the deadline, not left to run out; one with room runs."""
    for n in (3, 9, 17, 30):            # steps of several sizes: the step-time model fits
        client.complete(list(range(5, 5 + n)), {"max_tokens": 8}, timeout=60)
    before = refused(server, "deadline")
    # A machine busy with other work may not run the server's handler within the 50 ms
    # (DEADLINE_EXCEEDED, the client's own timer): up to three calls, one must be refused.
    for attempt in range(1, 4):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.complete([5, 6, 7], {"max_tokens": 120, "ignore_eos": True}, timeout=0.05)
        if e.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            break
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "after its deadline" in e.value.details() and time.monotonic() - t0 < 0.1
    assert before + 1 <= refused(server, "deadline") <= before + attempt
    done = client.complete([5, 6, 7], {"max_tokens": 4, "ignore_eos": True}, timeout=60,
                           priority=2)
    assert len(done.token_ids) == 4
    assert _wait_idle(server)["jaxinfer_kv_pages_used"] == 0


BAD = [  # (name, prompt, sampling, request_id, field)
    ("temperature", [5, 6], {"temperature": -1.0}, "", "temperature"),
    ("top_p", [5, 6], {"top_p": 0.0}, "", "top_p"),
    ("top_k", [5, 6], {"top_k": -2}, "", "top_k"),
    ("min_p", [5, 6], {"min_p": 1.5}, "", "min_p"),
    ("max_tokens", [5, 6], {"max_tokens": 0}, "", "max_tokens"),
    ("repetition_penalty", [5, 6], {"repetition_penalty": 0.0}, "", "repetition_penalty"),
    ("presence_penalty", [5, 6], {"presence_penalty": 9.0}, "", "presence_penalty"),
    ("frequency_penalty", [5, 6], {"frequency_penalty": -9.0}, "", "frequency_penalty"),
    ("seed", [5, 6], {"seed": -1}, "", "seed"),
    ("logprobs", [5, 6], {"logprobs": 21}, "", "logprobs"),
    ("stop_token_ids", [5, 6], {"stop_token_ids": [-4]}, "", "stop_token_ids"),
    ("stop utf8", [5, 6], {"stop": [b"\xff\xfe"]}, "", "stop"),
    ("token id too big", [5, VOCAB], {}, "", "prompt_token_ids"),
    ("negative token id", [5, -1], {}, "", "prompt_token_ids"),
    ("prompt over context", list(range(3, 131)), {}, "", "prompt_token_ids"),
    ("empty token ids", {"prompt_token_ids": []}, {}, "", "prompt_token_ids"),
    ("no prompt", None, {}, "", "prompt"),
    ("prompt utf8", b"caf\xc3", {}, "", "prompt"),
    ("text without tokenizer", "hello", {}, "", "prompt"),
    ("messages utf8", [{"role": "user", "content": b"\x80abc"}], {}, "", "messages"),
    ("request id", [5, 6], {}, "bad\nid", "request_id"),
]


@pytest.mark.parametrize("name,prompt,sampling,rid,field", BAD, ids=[b[0] for b in BAD])
def test_bad_input(client, name, prompt, sampling, rid, field):
    with pytest.raises(grpc.RpcError) as e:
        client.complete(prompt, sampling, request_id=rid or None, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert e.value.details().startswith(field), e.value.details()
    assert ("jaxinfer-field", field) in tuple(e.value.trailing_metadata())


def test_message_size_is_bounded(server):
    with Client(server.target, token=TOKEN, max_message_bytes=64 << 20) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(b"a" * (5 << 20), {"max_tokens": 2}, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_duplicate_request_id(client):
    stream = client.generate([7, 8, 9], {"max_tokens": 100}, request_id="dup", timeout=60)
    next(stream)
    with pytest.raises(grpc.RpcError) as e:
        client.complete([7, 8], {"max_tokens": 2}, request_id="dup", timeout=30)
    stream.cancel()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("request_id")


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"], ids=["none", "wrong", "close"])
def test_auth(server, token):
    with Client(server.target, token=token) as c:
        for call in (lambda: c.complete([5, 6], {"max_tokens": 2}, timeout=10),
                     lambda: c.model_info(timeout=10)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert c.health() == "SERVING"  # probes need no token


def test_metrics(server, client):
    client.complete([9, 10, 11, 12], {"max_tokens": 6, "temperature": 0.0}, timeout=30)
    m = metrics(server)
    for name in ("ttft_seconds", "inter_token_latency_seconds", "e2e_latency_seconds",
                 "queue_time_seconds", "step_seconds", "step_host_seconds"):
        assert m[f"jaxinfer_{name}_count"] > 0, name
    assert m["jaxinfer_output_tokens_total"] >= 6 and m["jaxinfer_compiles_total"] >= 1
    assert 0 < m["jaxinfer_step_tokens_total"] <= m["jaxinfer_step_bucket_tokens_total"]
    assert m["jaxinfer_kv_pages_usable"] > 0 and m["jaxinfer_preemptions_total"] >= 0
    # exported; they read 0 here: this tiny model's steps end before the host waits for
    # them, so their device time is unknown (tests/serve/test_metrics.py has the readings)
    for name in ("decode_hbm_bandwidth_bytes_per_second", "prefill_flops_per_second"):
        assert m[f"jaxinfer_{name}"] >= 0, name
    assert 0 <= m["jaxinfer_prefix_cache_hit_rate"] <= 1
    thread = {s.labels["part"]: s.value for s in _samples(server)
              if s.name == "jaxinfer_engine_thread_seconds_total"}
    assert set(thread) == {"idle", "commands", "step", "deliver", "observe"}, thread
    assert thread["step"] >= m["jaxinfer_step_seconds_sum"] * 0.99 and thread["idle"] > 0


def test_serving_bench_smoke(server, tmp_path):
    """bench/serving.py against this server over gRPC and HTTP: a tiny sweep of each writes
    the documented fields."""
    from bench import serving

    (tmp_path / "token").write_text(TOKEN)
    out = tmp_path / "serving.json"
    serving.main(["--target", server.target, "--http-target", f"127.0.0.1:{server.http_port}",
                  "--metrics-target", f"127.0.0.1:{server.metrics_port}", "--protocol", "both", "--auth-token-file", str(tmp_path / "token"),
                  "--rates", "3,12", "--chat-rates", "6", "--duration", "1", "--prompt-len",
                  "8,40", "--answer-len", "2,6", "--chat-system-len", "16", "--chat-user-len",
                  "4,12", "--chat-answer-len", "4,10", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["suite"] == "serving" and saved["model"] == "tiny"
    assert set(saved["max_rate_by_protocol"]) == {"grpc", "http"}
    assert saved["max_rate_p99_e2e_under_500ms"] == saved["max_rate_by_protocol"]["grpc"]
    assert set(saved["max_chat_rate_by_protocol"]) == {"grpc", "http"}
    assert [(r["protocol"], r["workload"], r["rate"]) for r in saved["rows"]] == [
        (p, w, r) for p in ("grpc", "http") for w, r in (("short", 3.0), ("short", 12.0),
                                                          ("chat", 6.0))]
    for r in saved["rows"]:
        assert r["throughput_rps"] > 0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["itl_p99_ms"] > 0 and r["e2e_p99_ms"] >= r["ttft_p50_ms"]
        # the server's steps during the rate, from its metrics
        assert r["steps"] > 0 and 0 < r["host_ms"] <= r["step_ms"] and 0 < r["host_share"] <= 1
        assert 0 <= r["padding"] < 1
        # the engine thread's time per step by part; its `step` holds the step metric's
        thread = r["thread_ms"]
        assert set(thread) == {"idle", "commands", "step", "deliver", "observe"}, thread
        assert all(v >= 0 for v in thread.values()) and thread["deliver"] > 0, thread
        assert thread["step"] >= 0.99 * r["step_ms"], (thread, r["step_ms"])


def test_server_log_has_no_errors(server):
    """Nothing above went down the INTERNAL path, and no prompt was logged."""
    log = server.log()
    at = max(log.find("Traceback"), log.find(" ERROR "))   # the failure's own lines
    assert "Traceback" not in log and " ERROR " not in log, log[max(0, at - 1000):at + 3000]
    assert "prompt not logged" in log


def test_malformed_message_is_invalid_argument(server):
    """Bytes that are no GenerateRequest get INVALID_ARGUMENT naming the request, not
    UNKNOWN."""
    with grpc.insecure_channel(server.target) as channel:
        generate = channel.unary_stream("/jaxinfer.v1.Inference/Generate",
                                        request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            list(generate(b"\xff\xff\xff\xff", timeout=30,
                          metadata=(("authorization", f"Bearer {TOKEN}"),)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid GenerateRequest" in e.value.details()
    assert dict(e.value.trailing_metadata())["jaxinfer-field"] == "request"
