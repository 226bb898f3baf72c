"""jaxinfer under Ray Serve: engine replicas behind one OpenAI-compatible HTTP ingress.

    serve run serve.ray_app:app model=smollm2 num_replicas=2 max_num_seqs=16

or from Python:

    from ray import serve
    from serve.ray_app import app
    serve.run(app({"model": "smollm2", "num_replicas": 2}), route_prefix="/")

`OpenAIIngress` (a FastAPI app on Ray's HTTP proxy) takes every request, reads its body and
hands it to an `EngineReplica` through a deployment handle; each replica runs jaxinfer's own
OpenAI app (serve/openai_http.py: the same endpoints, errors and streaming as `jaxinfer
serve --http-port`) over its own engine, and streams the response back through the handle.
The handle routes with `PrefixAffinityRouter` (Ray Serve's request-router hook): requests
whose prompts start alike go to the same replica, where jaxinfer's prefix cache holds their
KV (`router=default`: Ray's power-of-two-choices router). A replica's Ray health check is
its engine's readiness; Ray restarts a replica that fails it or dies. Autoscaling is Ray
Serve's own (`autoscaling_min_replicas`, `autoscaling_max_replicas`,
`target_ongoing_requests`).

Arguments (`app(args)`; strings from `serve run key=value` are parsed): model, num_replicas
(default 1), router (prefix | default), max_ongoing_requests (per replica, default 64),
num_cpus and num_gpus (per replica), prefix_chars (the prompt's first characters that pick
the replica, default 256), the autoscaling ones above, and any EngineConfig field
(max_num_seqs=16, tensor_parallel=1, ...).

Ray is an optional extra (`pip install 'jaxinfer[ray]'`); nothing outside this module imports
it.
"""

import asyncio
import dataclasses
import hashlib
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from jaxinfer.config import EngineConfig
from jaxinfer.engine_thread import EngineThread
from serve.admission import Admission
from serve.metrics import Metrics
from serve.openai_http import HttpSettings, build_app

log = logging.getLogger("jaxinfer.ray")

PREFIX_CHARS = 256
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}


@dataclasses.dataclass
class ForwardedRequest:
    """An HTTP request as the ingress hands it to a replica. `prefix`: the start of its
    prompt (what PrefixAffinityRouter routes by); None for requests without one."""

    method: str
    path: str
    query: bytes
    headers: list
    body: bytes
    prefix: str | None = None


def prompt_prefix(body: bytes, chars: int = PREFIX_CHARS) -> str | None:
    """The first `chars` characters of a completion's prompt or a chat's messages (their
    contents in order), or None when the body has neither."""
    try:
        req = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    prompt = req.get("messages", req.get("prompt"))
    if isinstance(prompt, list):      # messages, a list of prompts, or token ids
        prompt = "".join(_text(m) for m in prompt)
    return prompt[:chars] if isinstance(prompt, str) and prompt else None


def _text(item) -> str:
    """A message's (or a content part's) text."""
    if isinstance(item, dict):
        content = item.get("content", item.get("text"))
        if isinstance(content, str):
            return content
        return "".join(map(_text, content)) if isinstance(content, list) else ""
    return str(item)


class PrefixAffinityRouter(RequestRouter):
    """Rendezvous hashing of a request's prompt prefix over the replicas: the same prefix
    prefers the same replica (the one whose prefix cache holds it) while the set of replicas
    stays, and a replica that joins or leaves moves only the prefixes it wins or held. The
    preferred replica comes first; if it does not accept the request (its
    max_ongoing_requests are in flight), the others in turn. Requests without a prompt:
    any replica, the least loaded first. Each replica found goes to the request it was
    chosen for (RequestRouter's own matching; a FIFO router would hand it to the oldest
    request waiting, whatever its prefix).

    A replica answers the router's queue-length probe from its event loop, which a busy
    engine's host work can hold up past Ray's 0.1 s deadline, and a replica that misses it
    is passed over for this try: the preferred one is given 1 s (up to 5 s when probes
    keep missing), a small wait beside a generation, and a miss would send its prefix to a
    replica that does not hold it."""

    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 5.0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        prefix = _prefix_of(pending_request)
        if prefix is None or len(candidate_replicas) < 2:
            return [list(candidate_replicas)]
        ranked = sorted(candidate_replicas, reverse=True,
                        key=lambda r: rendezvous_weight(prefix, r.replica_id.unique_id))
        return [[ranked[0]], ranked[1:]]


def rendezvous_weight(prefix: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{replica}\0{prefix}".encode(), digest_size=8)
                          .digest(), "big")


def _prefix_of(pending: PendingRequest | None) -> str | None:
    """The prompt prefix of a ForwardedRequest among the request's arguments. Found by its
    attribute, not its class: Ray may deserialize this module's classes anew where the
    router runs."""
    if pending is None:
        return None
    return next((a.prefix for a in pending.args
                 if type(a).__name__ == "ForwardedRequest" and isinstance(a.prefix, str)), None)


@serve.deployment
class EngineReplica:
    """One engine and jaxinfer's OpenAI app over it (an ASGI app called in process)."""

    def __init__(self, model: str, engine_kwargs: dict, served_model_name: str | None = None,
                 max_waiting: int = 1024):
        from jaxinfer.engine import Engine

        cfg = EngineConfig(**engine_kwargs)
        self.engine = EngineThread(lambda: _warm(Engine.from_model(model, cfg)), max_waiting)
        # (warm before it is ready, as `jaxinfer serve` does: nothing compiles while serving)
        self.admission = Admission(self.engine, Metrics())
        self.app = build_app(self.admission, HttpSettings(served_model_name))
        self.engine.start()
        self.engine.ready.wait()
        if self.engine.error is not None:
            raise RuntimeError(f"the engine did not load: {self.engine.error}")

    def check_health(self) -> None:
        """Ray's health check: the engine is loaded, running and not failed."""
        if not self.admission.ready:
            raise RuntimeError(f"engine not ready (error: {self.engine.error})")

    def stats(self) -> dict:
        """The engine's statistics (prefix cache hits among them) and this replica's id."""
        return {**self.engine.engine.stats(), "replica": _replica_id()}

    async def forward(self, req: ForwardedRequest):
        """The app's response to `req`: (status, headers) first, then the body's chunks.
        Added headers: x-jaxinfer-replica (this replica's id) and this replica's prefix cache
        totals so far, x-jaxinfer-prefix-cache-hit-tokens of
        x-jaxinfer-prefix-cache-queried-tokens (the prompt tokens admitted)."""
        first = True
        async for item in call_asgi(self.app, req):
            if first:
                stats = self.engine.engine.stats()
                item = (item[0], [*item[1], ("x-jaxinfer-replica", _replica_id()),
                                  ("x-jaxinfer-prefix-cache-hit-tokens",
                                   str(stats["prefix_cache_hit_tokens"])),
                                  ("x-jaxinfer-prefix-cache-queried-tokens",
                                   str(stats["prefix_cache_queried_tokens"]))])
                first = False
            yield item


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


def _warm(engine):
    engine.warmup(progress=False)
    return engine


async def call_asgi(app, req: ForwardedRequest):
    """Run the ASGI `app` on `req`: yields (status, headers), then each body chunk. Closing
    the generator early tells the app the client left (its requests are aborted)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": req.method, "scheme": "http", "path": req.path,
             "raw_path": req.path.encode(), "query_string": req.query, "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in req.headers],
             "client": ("ray-ingress", 0), "server": ("ray-replica", 0)}
    sent, left = asyncio.Queue(), asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    try:
        while True:
            get = asyncio.ensure_future(sent.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                await task      # the app ended without (the rest of) a response: raise
                raise RuntimeError("the app ended before its response did")
            msg = get.result()
            if msg["type"] == "http.response.start":
                yield msg["status"], [(k.decode(), v.decode()) for k, v in msg["headers"]]
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body"):
                    break
        await task
    finally:
        left.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 10.0)
            except (asyncio.TimeoutError, Exception):
                task.cancel()


_ingress = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment
@serve.ingress(_ingress)
class OpenAIIngress:
    """Ray's HTTP proxy's app: each request goes whole to an engine replica."""

    def __init__(self, engines, prefix_chars: int = PREFIX_CHARS):
        self.engines = engines.options(stream=True)
        self.prefix_chars = prefix_chars

    @_ingress.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request):
        body = await request.body()
        req = ForwardedRequest(request.method, "/" + path, request.url.query.encode(),
                               list(request.headers.items()), body,
                               prompt_prefix(body, self.prefix_chars))
        stream = self.engines.forward.remote(req)
        try:
            status, headers = await stream.__anext__()
        except Exception as e:   # the replica died or could not take it
            log.warning("no replica answered %s: %r", req.path, e)
            return JSONResponse({"error": {
                "message": f"no engine replica could answer ({type(e).__name__}); retry",
                "type": "service_unavailable", "param": None,
                "code": "service_unavailable"}}, status_code=503)

        async def rest():
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                stream.cancel()
        return StreamingResponse(rest(), status_code=status, headers={
            k: v for k, v in headers if k.lower() not in _HOP_HEADERS})


_INTS = {"num_replicas", "max_ongoing_requests", "prefix_chars", "autoscaling_min_replicas",
         "autoscaling_max_replicas", "max_waiting"}
_FLOATS = {"num_cpus", "num_gpus", "target_ongoing_requests"}
_OWN = _INTS | _FLOATS | {"model", "router", "served_model_name"}


def app(args: dict[str, Any]):
    """The Ray Serve application (`serve run serve.ray_app:app key=value ...`); see the
    module doc for the arguments. Unknown ones that are not EngineConfig fields raise
    ValueError naming them."""
    args = dict(args)
    model = args.pop("model", "smollm2")
    router = args.pop("router", "prefix")
    if router not in ("prefix", "default"):
        raise ValueError(f"router must be 'prefix' or 'default', got {router!r}")
    own = {k: _parse(k, args.pop(k)) for k in list(args) if k in _OWN}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}: not an option of the "
                         f"Ray app nor an EngineConfig field")
    engine_kwargs = {k: _engine_value(v) for k, v in args.items()}
    EngineConfig(**engine_kwargs)       # a bad value fails here, not in every replica
    options: dict = {"max_ongoing_requests": own.get("max_ongoing_requests", 64),
                     "ray_actor_options": {"num_cpus": own.get("num_cpus", 1.0),
                                           "num_gpus": own.get("num_gpus", 0.0)},
                     "health_check_period_s": 5.0, "health_check_timeout_s": 30.0}
    if "autoscaling_max_replicas" in own:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=own.get("autoscaling_min_replicas", 1),
            max_replicas=own["autoscaling_max_replicas"],
            target_ongoing_requests=own.get("target_ongoing_requests", 16))
    else:
        options["num_replicas"] = own.get("num_replicas", 1)
    if router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter)
    engines = EngineReplica.options(**options).bind(
        model, engine_kwargs, own.get("served_model_name"), own.get("max_waiting", 1024))
    return OpenAIIngress.options(ray_actor_options={"num_cpus": 0}).bind(
        engines, own.get("prefix_chars", PREFIX_CHARS))


def _parse(key: str, value):
    if not isinstance(value, str):
        return value
    try:
        return int(value) if key in _INTS else float(value) if key in _FLOATS else value
    except ValueError:
        raise ValueError(f"{key} must be a number, got {value!r}") from None


def _engine_value(value):
    """A `serve run` string as JSON when it reads as JSON (16, 0.5, true, null), else the
    string itself (bf16, fp8); EngineConfig checks the value."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
