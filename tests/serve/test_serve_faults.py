"""The server under injected step failures (tests/serve/fault_server.py): only the requests
of a failed step fail, with INTERNAL; every other answer equals a clean run's; the server
stays up and ends with no page in use."""
import concurrent.futures as cf
import json
import os
import time
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

    with ServerProcess([*ENGINE_ARGS, "--max-waiting", "1000"], env=env,
                       module="fault_server") as srv:
        srv.wait_serving(timeout=240)

        def stream(t):
            """Requests one after another until every fault was injected."""
            outcomes = []
            with Client(srv.target) as c:
                for k in range(2000):
                    if len(injected()) >= FAULTS and k > 2:
                        break
                    i, rid = (t + STREAMS * k) % len(prompts), f"s{t}-{k}"
                    try:
                        got = c.complete({"prompt_token_ids": prompts[i]}, params,
                                         request_id=rid, timeout=120)
                        outcomes.append((rid, i, got.token_ids))
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.INTERNAL, e.details()
                        assert "engine step running this request failed" in e.details()
                        outcomes.append((rid, i, None))
            return outcomes

        with cf.ThreadPoolExecutor(STREAMS) as pool:
            outcomes = [o for os_ in pool.map(stream, range(STREAMS)) for o in os_]
        faults = injected()
        assert len(faults) == FAULTS
        blamed = {rid for f in faults for rid in f["request_ids"] or ()}
        failed = {rid for rid, _, ids in outcomes if ids is None}
        assert failed and failed <= blamed
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
