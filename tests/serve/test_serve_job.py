"""`jaxinfer serve` as a job of two processes x 2 CPU devices (--tensor-parallel 4 across
both, gloo collectives over loopback): the official `openai` client gets SmolLM2's greedy
answers, the text of LLM.generate in one process on one device; then the follower is killed
mid-stream: the stream ends in an error, and the leader reports NOT_SERVING, names the lost
process and exits non-zero, within the heartbeat timeout, instead of hanging."""
import os
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from engine_util import free_port
from jaxinfer.llm import LLM
from jaxinfer.request import SamplingParams
from serve.launcher import ServerProcess

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colors."}]
HEARTBEAT_S = 20   # generous: two processes compile side by side on a loaded CI machine


@pytest.fixture(scope="module")
def job():
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    args = ["--model", "smollm2", "--http-port", "0", "--tensor-parallel", "4", *flags,
            "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2",
            "--heartbeat-timeout", str(HEARTBEAT_S)]
    env = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                         + " --xla_force_host_platform_device_count=2").strip()}
    procs = [ServerProcess([*args, "--process-id", str(i)], env=env) for i in (0, 1)]
    try:
        procs[0].wait_serving(timeout=600)
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_served_answers_equal_one_process_then_a_lost_follower_ends_the_job(job):
    leader, follower = job
    client = openai.OpenAI(base_url=leader.http_url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    llm = LLM("smollm2", **ENGINE)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    want = llm.generate([*PROMPTS, CHAT], greedy, use_tqdm=False)
    got = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=12,
                                    temperature=0)
    assert [c.text for c in got.choices] == [w.text for w in want[:2]]
    assert got.choices[0].text.startswith(" Paris")
    chat = client.chat.completions.create(model="smollm2", messages=CHAT,
                                          max_completion_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want[2].text

    # The follower dies mid-stream: the client gets an error, not a hang; the leader's
    # health turns NOT_SERVING, then it exits non-zero naming the lost process.
    stream = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text, finish, t0, probe = "", None, None, None
    with _ClientError() as ended:
        for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
            if t0 is None and len(text) > 8:
                follower.proc.kill()
                t0 = time.monotonic()
                probe = _HealthProbe(leader)
    assert t0 is not None, "the stream ended before the follower was killed"
    assert ended.error is not None or finish not in ("length", "stop"), (text, finish)
    code = leader.proc.wait(timeout=HEARTBEAT_S + 110)
    took = time.monotonic() - t0
    probe.thread.join(timeout=5)
    assert code != 0, leader.log()[-3000:]
    assert took < HEARTBEAT_S, (f"the leader took {took:.0f} s to end", leader.log()[-3000:])
    assert "NOT_SERVING" in probe.seen, (probe.seen, took, code, leader.log()[-4000:])
    assert "process 1 of 2 is lost" in leader.log(), leader.log()[-3000:]


class _HealthProbe:
    """GET /health every 0.1 s until the server's process ends: the statuses seen."""

    def __init__(self, server):
        self.server, self.seen = server, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.server.proc.poll() is None:
            try:
                urllib.request.urlopen(self.server.http_url + "/health", timeout=2)
                status = "SERVING"
            except urllib.error.HTTPError as e:
                status = "NOT_SERVING" if e.code == 503 else str(e.code)
            except OSError:
                status = "DOWN"
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            time.sleep(0.1)


class _ClientError:
    """A context that keeps the client error its body raised (the openai client's, or its
    HTTP transport's) instead of raising it."""

    error = None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None and (issubclass(kind, (openai.APIError, OSError))
                                 or kind.__module__.split(".")[0].startswith("httpx")):
            self.error = value
            return True
        return False
