"""A TLS server with the real SmolLM2 (text and chat prompts): text equals LLM.generate's, the
`jaxinfer client` command, reflection, and the SIGTERM drain (last: it ends the server)."""
import json
import re
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.request import SamplingParams
from serve.cli import add_client_arguments, run_client
from serve.client import Client, channel_credentials
from serve.launcher import ServerProcess

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, dtype="float32")
ENGINE_ARGS = ["--model", "smollm2", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
               "--max-model-len", "256", "--dtype", "float32"]


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", d / "key.pem", "-out", d / "cert.pem", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def server(cert):
    srv = ServerProcess([*ENGINE_ARGS, "--tls-cert", str(cert[0]), "--tls-key", str(cert[1]),
                         "--grace-period", "60", "--http-port", "0"])
    try:
        srv.wait_listening()
        srv.wait_serving(timeout=300, tls_ca=cert[0])
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server, cert):
    with Client(server.target, tls_ca=cert[0]) as c:
        yield c


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", engine_config=EngineConfig(**ENGINE))


def test_tls_text_and_chat_equal_llm_generate(client, llm):
    prompts = ["The capital of France is", [{"role": "user", "content": "Name three colors."}],
               "def fibonacci(n):"]
    params = [SamplingParams(max_tokens=20, temperature=0.0),
              SamplingParams(max_tokens=24, temperature=0.0, stop=["\n\n", "."]),
              SamplingParams(max_tokens=20, temperature=0.8, seed=7)]
    want = llm.generate(prompts, params, use_tqdm=False)
    for p, sp, w in zip(prompts, params, want):
        got = client.complete(p, sp, timeout=120)
        assert (got.text, got.token_ids, got.finish_reason) == (
            w.text, w.token_ids, str(w.finish_reason))


def test_https_chat_equals_grpc(server, cert, client):
    """The HTTP API shares the TLS certificate; plain HTTP gets no answer from it."""
    body = json.dumps({"messages": [{"role": "user", "content": "Name three colors."}],
                       "max_tokens": 12, "temperature": 0}).encode()
    url = f"https://localhost:{server.http_port}/v1/chat/completions"
    req = urllib.request.Request(url, body, {"content-type": "application/json"})
    ctx = ssl.create_default_context(cafile=str(cert[0]))
    with urllib.request.urlopen(req, timeout=120, context=ctx) as r:
        got = json.loads(r.read())
    want = client.complete([{"role": "user", "content": "Name three colors."}],
                           {"max_tokens": 12, "temperature": 0.0}, timeout=120)
    assert got["choices"][0]["message"]["content"] == want.text
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(url.replace("https://", "http://"), body, timeout=10)


def test_plaintext_client_cannot_talk_to_tls_server(server):
    with Client(server.target) as c, pytest.raises(grpc.RpcError) as e:
        c.model_info(timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_reflection_lists_services(server, cert):
    channel = grpc.secure_channel(server.target, channel_credentials(cert[0]))
    try:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    finally:
        channel.close()
    assert {"jaxinfer.v1.Inference", "grpc.health.v1.Health"} <= services


def test_client_command_streams_text(server, cert, capsys, client):
    import argparse

    p = argparse.ArgumentParser()
    add_client_arguments(p)
    args = p.parse_args(["The capital of France is", "--target", server.target, "--tls-ca",
                         str(cert[0]), "--max-tokens", "12"])
    assert run_client(args) == 0
    want = client.complete("The capital of France is", {"max_tokens": 12, "temperature": 0.0})
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == want.text and "[length: " in out.err


def test_sigterm_drains_then_exits_zero(server, cert):
    """Health NOT_SERVING and new requests UNAVAILABLE at once; in-flight ones finish."""
    results, started = {}, threading.Barrier(3, timeout=120)

    def long_request(i):
        with Client(server.target, tls_ca=cert[0]) as c:
            stream = c.generate(f"Story number {i}:", {"max_tokens": 64, "temperature": 0.0,
                                                        "ignore_eos": True}, timeout=200)
            first = next(stream)
            started.wait()
            rest = list(stream)
            results[i] = (len(first.token_ids) + sum(len(r.token_ids) for r in rest),
                          Client.finish_reason(rest[-1]))

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait()
    server.terminate()
    with Client(server.target, tls_ca=cert[0]) as c:
        deadline = time.monotonic() + 30
        while c.health() != "NOT_SERVING" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            c.complete("Hello", {"max_tokens": 2}, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(200)
    assert results == {0: (64, "length"), 1: (64, "length")}
    assert server.proc.wait(60) == 0
    assert "draining: 2 requests in flight" in server.log()


def test_sigterm_while_loading_exits_zero():
    with ServerProcess(["--model", "tiny", "--max-model-len", "64"]) as srv:
        srv.wait_listening()
        with Client(srv.target) as c:
            assert c.health() == "NOT_SERVING"
        srv.terminate()
        assert srv.proc.wait(60) == 0, srv.log()


def test_a_model_that_fails_to_load_exits_non_zero_and_says_why(tmp_path):
    """The port opens before the model loads; a model that then fails to load is logged,
    the server exits 1, and a launcher waiting for SERVING reports the exit and the log,
    not a refused connection."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with ServerProcess(["--model", str(bad)]) as srv:
        with pytest.raises(RuntimeError) as failed:
            srv.wait_serving(timeout=120)
        assert srv.proc.wait(60) == 1
    message = str(failed.value)
    assert message.startswith("server exited with status 1 before it was SERVING"), message
    assert f"could not load the model: {bad} is not a valid GGUF file" in message


def test_client_waits_for_a_server_still_loading():
    """A client that arrives while the server loads and compiles (health NOT_SERVING) waits
    for SERVING instead of failing: a short wait ends in DEADLINE_EXCEEDED, a long one in
    the answer."""
    with ServerProcess(["--model", "tiny", "--max-model-len", "64", "--max-num-seqs", "2",
                        "--max-num-batched-tokens", "16"]) as srv:
        srv.wait_listening()
        with Client(srv.target) as c:
            assert c.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as waited:
                c.wait_until_ready(timeout=0.2)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            c.wait_until_ready(timeout=300)
            assert c.health() == "SERVING"
            done = c.complete({"prompt_token_ids": [5, 6, 7]}, {"max_tokens": 3,
                                                                "temperature": 0.0})
            assert len(done.token_ids) == 3 and done.finish_reason == "length"
        srv.terminate()
        assert srv.proc.wait(60) == 0, srv.log()
    # the log shows the compile's progress, executable by executable, and the time to ready
    log = srv.log()
    total = int(re.search(r"compiled 1/(\d+) step executables", log).group(1))
    assert f"compiled {total}/{total} step executables" in log and "ready" in log


@pytest.mark.parametrize("token_file, env, says", [
    ("blank", {}, "holds no token"),
    ("missing", {}, "cannot read it"),
    (None, {"JAXINFER_AUTH_TOKEN": "  "}, "holds no token"),
    (None, {}, "--metrics-auth needs a token"),
])
def test_auth_fails_closed(tmp_path, token_file, env, says):
    """A token file or variable holding no token refuses to start (one line, no traceback)
    instead of serving without authentication."""
    import os
    import sys

    args = [sys.executable, "-m", "serve.cli", "--model", "tiny", "--port", "0"]
    if token_file == "blank":
        (tmp_path / "blank").write_text("  \n\t\n")
    if token_file:
        args += ["--auth-token-file", str(tmp_path / token_file)]
    if not token_file and not env:
        args += ["--metrics-port", "0", "--metrics-auth"]
    environ = {k: v for k, v in os.environ.items() if k != "JAXINFER_AUTH_TOKEN"}
    done = subprocess.run(args, capture_output=True, text=True, timeout=120,
                          env={**environ, **env})
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
