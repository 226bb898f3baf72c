"""jaxinfer under Ray Serve (serve/ray_app.py): 2 SmolLM2 replicas behind Ray's HTTP proxy
answer the official `openai` client as one engine does, requests that share a prompt prefix
stay on one replica, a replica killed under load is replaced while no request waits past
its deadline; the prefix router's choices and the KubeRay manifest are checked without a
cluster."""
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

# Ray's processes inherit these: on a 2-core machine shared with other tests the proxy and
# the replicas take longer than Ray's 5 s readiness checks to start.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "120")

from engine_util import free_port  # noqa: E402
from serve.ray_app import (ForwardedRequest, PrefixAffinityRouter, app,  # noqa: E402
                           prompt_prefix, rendezvous_weight)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent          # ray's and serve's CLIs beside this python
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256}
# System prompts longer than the prefix the router reads (256 characters): requests that
# share one share their prefix, whatever the user asks.
SYSTEM = [" ".join(["You are a terse assistant. Answer in one short sentence."] * 6),
          " ".join(["You are a poet. Every answer rhymes and mentions the sea."] * 6)]


def test_prompt_prefix_reads_chat_messages_and_prompts():
    chat = b'{"messages": [{"role": "system", "content": "Be brief."}, ' \
           b'{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}'
    assert prompt_prefix(chat) == "Be brief.Hi"
    assert prompt_prefix(b'{"prompt": "abcdef"}', chars=3) == "abc"
    assert prompt_prefix(b'{"prompt": ["ab", "cd"]}') == "abcd"
    for body in (b"", b"not json", b"[1, 2]", b'{"model": "x"}', b'{"prompt": ""}'):
        assert prompt_prefix(body) is None


def _replicas(*names):
    return [types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id=n)) for n in names]


def _choose(candidates, prefix):
    router = object.__new__(PrefixAffinityRouter)    # choose_replicas reads no state
    pending = types.SimpleNamespace(args=[ForwardedRequest("POST", "/v1/completions", b"",
                                                           [], b"", prefix)])
    import asyncio
    return asyncio.run(router.choose_replicas(candidates, pending))


def test_a_prefix_prefers_one_replica_and_a_replica_leaving_moves_only_its_own():
    three = _replicas("a", "b", "c")
    prefixes = [f"system prompt {i}" for i in range(300)]
    first = {p: _choose(three, p)[0][0].replica_id.unique_id for p in prefixes}
    assert {p: _choose(three, p)[0][0].replica_id.unique_id for p in prefixes} == first
    assert all(n > 60 for n in (list(first.values()).count(r) for r in "abc"))   # spread
    ranks = _choose(three, prefixes[0])
    assert len(ranks) == 2 and len(ranks[0]) == 1 and len(ranks[1]) == 2   # then the others
    two = _replicas("a", "b")
    moved = [p for p in prefixes if _choose(two, p)[0][0].replica_id.unique_id != first[p]]
    assert moved and all(first[p] == "c" for p in moved)
    assert _choose(three, None) == [three]       # no prompt: any replica, least loaded
    assert rendezvous_weight("x", "a") == rendezvous_weight("x", "a")


def test_app_arguments_are_checked_before_any_replica_starts():
    with pytest.raises(ValueError, match="max_num_sequences"):
        app({"model": "smollm2", "max_num_sequences": 4})
    with pytest.raises(ValueError, match="router"):
        app({"router": "random"})
    with pytest.raises(ValueError, match="num_replicas must be a number"):
        app({"num_replicas": "two"})


def test_the_kuberay_manifest_runs_this_app_with_gpus_on_the_workers():
    doc = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (application,) = serve_cfg["applications"]
    assert application["import_path"] == "serve.ray_app:app"
    assert application["route_prefix"] == "/"
    args = application["args"]
    app(args)                            # the args build the application
    cluster = doc["spec"]["rayClusterConfig"]
    import ray
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"containerPort": 8000, "name": "serve"} in head["ports"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["minReplicas"] <= args["autoscaling_min_replicas"]
    assert workers["maxReplicas"] >= args["autoscaling_max_replicas"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == args["num_gpus"]
    mounts = workers["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(args["model"].startswith(m["mountPath"] + "/") for m in mounts)


@pytest.fixture(scope="module")
def llm():
    """One engine of the replicas' configuration in this process (the reference answers),
    warmed before the cluster starts: the replicas, started side by side, load its step
    programs from the run's compilation cache instead of each compiling them."""
    from jaxinfer import LLM
    return LLM("smollm2", **ENGINE, warmup=True)


@pytest.fixture(scope="module")
def cluster(llm):
    """A Ray cluster on this machine (`ray start --head`), the application deployed on it by
    Ray's CLI as the README shows (`serve run serve.ray_app:app key=value ...`): 2 SmolLM2
    replicas behind Ray's HTTP proxy. Yields the base URL; this process is a driver of the
    cluster, so the tests can kill replicas and read Serve's status."""
    import ray
    from ray import serve
    gcs, http = free_port(), free_port()
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=4",
         "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ray.init(address=_wait_for_head(head, gcs), log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": http})
        args = {"model": "smollm2", "num_replicas": 2, "num_cpus": 1, **ENGINE}
        run = subprocess.run(
            [str(BIN / "serve"), "run", f"--address=127.0.0.1:{gcs}", "--non-blocking",
             "--name=jaxinfer", "serve.ray_app:app", *(f"{k}={v}" for k, v in args.items())],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        yield f"http://127.0.0.1:{http}"
    finally:
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        head.terminate()                 # `ray start --block` stops the cluster it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _wait_for_head(head, port, timeout=120.0):
    """The head's address once its port answers; fails early if `ray start` exited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if head.poll() is not None:
            pytest.fail(f"ray start exited with status {head.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"ray start did not listen on port {port} in {timeout:.0f} s")


def _client(base, timeout=120.0):
    import openai
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=timeout,
                         max_retries=0)


def test_two_replicas_answer_the_openai_client_as_one_engine_does(cluster, llm):
    from jaxinfer import SamplingParams
    client = _client(cluster)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    got = [client.completions.create(model="smollm2", prompt=p, max_tokens=8,
                                     temperature=0).choices[0].text for p in prompts]
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=10, temperature=0, stream=True)
    chat = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert got == [o.text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got[0].startswith(" Paris")
    want = llm.chat([{"role": "user", "content": "Name three colors."}],
                    SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert chat == want.text


def test_requests_sharing_a_system_prompt_stay_on_one_replica(cluster):
    """Sent 4 at a time: each replica the router finds goes to the request it chose it
    for, not to whichever waits longest."""
    client = _client(cluster)

    def ask(item):
        i, system = item
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}])
        raw.parse()
        return system, raw.headers["x-jaxinfer-replica"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, [(i, s) for i in range(4) for s in SYSTEM]))
    seen = {s: {r for system, r in answers if system == s} for s in SYSTEM}
    assert all(len(replicas) == 1 for replicas in seen.values()), seen


def test_a_replica_killed_under_load_is_replaced_and_no_request_outlives_its_deadline(cluster):
    import openai
    import ray
    from ray import serve
    deadline = 180.0      # generous: other tests share this machine's 2 cores in CI
    client = _client(cluster, timeout=deadline)

    def ask(i):
        t0 = time.monotonic()
        try:
            client.completions.create(model="smollm2", prompt=f"Count to {i}:", max_tokens=12,
                                      temperature=0)
            ok = True
        except openai.APIError as e:
            ok = type(e).__name__
        return ok, time.monotonic() - t0

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if "EngineReplica" in a["name"]]
    assert len(names) == 2, names
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        time.sleep(1.0)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        results = [f.result(timeout=deadline + 30) for f in futures]
    assert all(took < deadline + 5 for _, took in results), results
    assert any(ok is True for ok, _ in results), results   # the other replica kept answering
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:            # Ray starts a new replica
        status = serve.status().applications["jaxinfer"].deployments["EngineReplica"]
        alive = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "EngineReplica" in a["name"]]
        if status.status == "HEALTHY" and len(alive) == 2 and names[0] not in alive:
            break
        time.sleep(2.0)
    else:
        pytest.fail(f"the killed replica was not replaced: {status}")
    later = [ask(i) for i in range(4)]
    assert all(ok is True for ok, _ in later), later
