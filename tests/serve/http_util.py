"""Plain-HTTP helpers for the HTTP API's tests (beside the official openai client)."""
import json
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


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
