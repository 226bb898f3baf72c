"""Plain-HTTP helpers for the HTTP API's tests (beside the official openai client), and the
SmolLM2 server they run against."""
import contextlib
import json
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

from serve.launcher import ServerProcess

SMOL_ARGS = ["--model", "smollm2", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
             "--max-model-len", "256", "--dtype", "float32"]


def call(url, body=None, token=None, method=None, headers=None):
    """(status, decoded JSON or text) of one request, errors included."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "content-type": "application/json", **({"authorization": f"Bearer {token}"} if token
                                               else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def metrics(url) -> dict:
    """Unlabelled samples by name; labelled ones as name{value,...}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.name + ("{%s}" % ",".join(s.labels.values()) if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@contextlib.contextmanager
def smol_server(token_dir, token: str, *args: str):
    """A SmolLM2 server subprocess (SMOL_ARGS) with the HTTP API on, requiring bearer `token`
    (written to token_dir/token) on the API and the metrics port; `args`: more server flags.
    Yields it once serving; stops it after."""
    token_file = token_dir / "token"
    token_file.write_text(token)
    with ServerProcess([*SMOL_ARGS, "--http-port", "0", "--auth-token-file", str(token_file),
                        "--metrics-auth", *args]) as srv:
        srv.wait_serving(timeout=300)
        yield srv


@contextlib.contextmanager
def smol_client(srv, token: str):
    """The official openai client of `srv`'s HTTP API, authenticated with `token`."""
    with openai.OpenAI(base_url=srv.http_url + "/v1", api_key=token, max_retries=0,
                       timeout=120) as c:
        yield c
