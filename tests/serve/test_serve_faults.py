"""The server under injected step failures (tests/serve/fault_server.py): only the requests
of a failed step fail, with INTERNAL; every other answer equals a clean run's; the server
stays up and ends with no page in use."""
import concurrent.futures as cf
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.request import SamplingParams
from serve.client import Client
from serve.launcher import ServerProcess

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, page_size=4,
              dtype="float32")
ENGINE_ARGS = ["--model", "tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
               "--max-model-len", "128", "--page-size", "4", "--dtype", "float32"]
FAULTS = 100
STREAMS = 20
HERE = Path(__file__).resolve().parent


def gauges(port) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def test_injected_step_failures_fail_only_their_requests(tmp_path):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 512, rng.integers(3, 30)).tolist() for _ in range(40)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM("tiny", engine_config=EngineConfig(**ENGINE)).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    record = tmp_path / "faults.jsonl"
    record.touch()
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "FAULT_RATE": "0.03", "FAULT_SEED": "5", "FAULT_MAX": str(FAULTS),
           "FAULT_SLOW_S": "0.02", "FAULT_RECORD": str(record)}

    def injected():
        return [json.loads(line) for line in record.read_text().splitlines()]

    with ServerProcess([*ENGINE_ARGS, "--max-waiting", "1000", "--http-port", "0"], env=env,
                       module="fault_server") as srv:
        srv.wait_serving(timeout=240)

        def grpc_request(c, i, rid):
            try:
                return c.complete({"prompt_token_ids": prompts[i]}, params, request_id=rid,
                                  timeout=120).token_ids
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INTERNAL, e.details()
                assert "engine step running this request failed" in e.details()
                return None

        def http_request(i):
            """A streamed completion: (its engine request id, token ids or None)."""
            req = urllib.request.Request(
                srv.http_url + "/v1/completions", json.dumps(
                    {"prompt": prompts[i], "max_tokens": 16, "temperature": 0,
                     "ignore_eos": True, "stream": True, "return_token_ids": True}).encode(),
                {"content-type": "application/json"})
            try:
                resp = urllib.request.urlopen(req, timeout=120)
            except urllib.error.HTTPError as e:   # failed before the stream started
                body = json.loads(e.read())
                assert e.code == 500 and body["error"]["code"] == "engine_error", body
                return body.get("id"), None
            ids, rid = [], None
            with resp:
                for line in resp:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        assert event["error"]["code"] == "engine_error", event
                        return rid, None
                    rid = event["id"]
                    ids += event["choices"][0].get("token_ids", [])
            return rid, ids

        def stream(t):
            """Requests one after another until every fault was injected (odd streams over
            HTTP, even ones over gRPC)."""
            outcomes = []
            with Client(srv.target) as c:
                for k in range(2000):
                    if len(injected()) >= FAULTS and k > 2:
                        break
                    i = (t + STREAMS * k) % len(prompts)
                    if t % 2:
                        rid, ids = http_request(i)
                    else:
                        rid = f"s{t}-{k}"
                        ids = grpc_request(c, i, rid)
                    outcomes.append((rid, i, ids))
            return outcomes

        with cf.ThreadPoolExecutor(STREAMS) as pool:
            outcomes = [o for os_ in pool.map(stream, range(STREAMS)) for o in os_]
        faults = injected()
        assert len(faults) == FAULTS
        blamed = {rid for f in faults for rid in f["request_ids"] or ()}
        failed = {rid for rid, _, ids in outcomes if ids is None}
        assert failed and failed - {None} <= blamed
        assert any(r.startswith("cmpl-") for r in failed - {None})   # HTTP ones too
        for rid, i, ids in outcomes:
            if ids is not None:
                assert ids == want[i], rid
        deadline = time.monotonic() + 30
        while gauges(srv.metrics_port)["jaxinfer_kv_pages_used"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gauges(srv.metrics_port)["jaxinfer_kv_pages_used"] == 0
        with Client(srv.target) as c:
            assert c.health() == "SERVING"
            assert c.complete({"prompt_token_ids": prompts[0]}, params,
                              timeout=60).token_ids == want[0]
        assert srv.log().count("engine step") >= FAULTS


def test_engine_that_cannot_recover_exits_non_zero(tmp_path):
    """A failed step whose recovery fails too: the request fails, the server stops serving
    and exits 1 (for a supervisor to restart it)."""
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "FAULT_RATE": "1", "FAULT_MAX": "1", "FAULT_DEAD": "1", "FAULT_PHASES": "dispatched",
           "FAULT_RECORD": str(tmp_path / "faults.jsonl")}
    with ServerProcess(ENGINE_ARGS, env=env, module="fault_server") as srv:
        srv.wait_serving(timeout=240)
        with Client(srv.target) as c:
            try:
                c.complete({"prompt_token_ids": [5, 6, 7]}, {"max_tokens": 4}, timeout=60)
                raise AssertionError("the request succeeded")
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert srv.proc.wait(60) == 1
    log = srv.log()
    assert "failed beyond recovery" in log and "exiting" in log
