"""SIGTERM under load drains within the grace period, every time: 20 servers, each killed
with streams in flight; every stream ends with its full answer and the server exits 0."""
import concurrent.futures as cf
import re
import threading
import time

import pytest

from serve.client import Client
from serve.launcher import ServerProcess

ARGS = ["--model", "tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--max-model-len", "256", "--page-size", "4", "--dtype", "float32",
        "--grace-period", "30"]
RUNS, STREAMS, TOKENS = 20, 6, 120


def drain_once(run: int) -> float:
    """One server, STREAMS streams, SIGTERM once all have tokens; the drain's seconds."""
    with ServerProcess(ARGS) as srv:
        srv.wait_serving(timeout=240)
        started, results = threading.Barrier(STREAMS + 1, timeout=120), {}

        def stream(i):
            with Client(srv.target) as c:
                n, last = 0, None
                for k, resp in enumerate(c.generate(
                        {"prompt_token_ids": [5 + i, 6 + run % 7, 7]},
                        {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True},
                        timeout=120)):
                    n += len(resp.token_ids)
                    last = resp
                    if k == 0:
                        started.wait()
                results[i] = (n, Client.finish_reason(last))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        started.wait()
        t0 = time.monotonic()
        srv.terminate()
        for t in threads:
            t.join(120)
        assert srv.proc.wait(120) == 0, srv.log()
        took = time.monotonic() - t0
        log = srv.log()
    assert results == {i: (TOKENS, "length") for i in range(STREAMS)}, (results, log)
    assert "grace period over" not in log
    drained = re.search(r"draining: (\d+) requests in flight", log)
    assert drained and int(drained.group(1)) >= 1, log
    return took


@pytest.mark.slow
def test_sigterm_under_load_drains_every_time():
    # The first server alone compiles the step programs into the run's compilation cache;
    # the others, two at a time, load them instead of compiling them side by side.
    took = [drain_once(0)]
    with cf.ThreadPoolExecutor(2) as pool:
        took += pool.map(drain_once, range(1, RUNS))
    assert len(took) == RUNS and max(took) < 30
