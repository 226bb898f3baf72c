"""The OpenAI-compatible HTTP API (FastAPI), beside the gRPC service on the same engine thread.

    POST /v1/completions        POST /v1/chat/completions     (stream: server-sent events)
    GET  /v1/models             GET  /v1/models/{model}   (the model and its LoRA adapters)
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter  (with --allow-runtime-lora)
    POST /tokenize              POST /detokenize
    GET  /health                200 when ready; 503 while loading or draining
    GET  /metrics               the server's Prometheus registry

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for an invalid
field (`param` names it), 401 for a missing or wrong bearer token (when auth is on; /health
stays open for health probes), 404 for an unknown model or path (a request's `model` is the
served model or a loaded LoRA adapter, which then answers),
413 for a body over the size limit, 429 when the waiting queue is full, 500 when the engine
step running the request failed (other requests go on; mid-stream: an error event), 503 while
loading, draining or after the engine failed for good. A client that disconnects (mid-stream or while waiting) has its requests aborted;
their pages are free for the next step.

A streamed response starts once every prompt of the request has its first output, so an
error the engine finds in a prompt (too long, a token outside the vocabulary) still gets its
status code rather than a broken stream.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer import openai_protocol as oai
from jaxinfer import openai_responses as oresp
from jaxinfer.errors import InvalidRequestError
from serve.admission import Admission, Refused, RequestFailed
from serve.openai_errors import ApiError, error_response
from serve.openai_lora import LoRAEndpoints
from serve.openai_stream import Call, EventStream, failing_as_event, sse
from serve.auth import digest

log = logging.getLogger("jaxinfer.serve")
_REFUSED = {"loading": (503, "service_unavailable"), "draining": (503, "service_unavailable"),
            "failed": (503, "service_unavailable"), "queue_full": (429, "rate_limit_exceeded")}

@dataclasses.dataclass(frozen=True)
class HttpSettings:
    served_model_name: str | None = None   # None: the engine's model name
    auth_token: str | None = None
    max_body_bytes: int = 4 << 20
    log_prompts: bool = False
    allow_runtime_lora: bool = False    # /v1/load_lora_adapter and /v1/unload_lora_adapter


class OpenAIApi(LoRAEndpoints):
    def __init__(self, admission: Admission, settings: HttpSettings):
        self.admission, self.settings = admission, settings
        self._expected = (digest(f"Bearer {settings.auth_token}") if settings.auth_token
                          else None)
        self._token_text = None

    # --- helpers ------------------------------------------------------------------------
    @property
    def _engine(self):
        return self.admission.engine.engine

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self._engine.model_name

    def authorize(self, request: Request) -> None:
        if self._expected is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(digest(sent), self._expected):
            raise ApiError(401, "missing or wrong bearer token (send the header "
                                "'Authorization: Bearer <token>')", code="invalid_api_key")

    async def read_json(self, request: Request):
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}",
                           code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes",
                               code="request_too_large")
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", param="body",
                           code="invalid_json") from None

    def check_model(self, model: str | None) -> str:
        """The model a request names: the served model (also for None) or a loaded LoRA
        adapter's name; 404 for anything else."""
        self.admission.check()
        if model is None or model == self.model_name:
            return self.model_name
        adapters = self._engine.lora_names()
        if model not in adapters:
            also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'{also}", param="model",
                           code="model_not_found")
        return model

    def _for_model(self, model: str, params):
        """The request's params with its LoRA adapter when `model` names one."""
        return params if model == self.model_name else dataclasses.replace(params, lora=model)

    def token_text(self, token_id: int) -> str:
        if self._token_text is None:     # the engine (and its tokenizer) loads after start
            self._token_text = oresp.token_text_fn(self._engine.tokenizer)
        return self._token_text(token_id)

    def _tokenizer(self, field: str):
        tok = self._engine.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer", field=field)
        return tok

    # --- completions and chat -----------------------------------------------------------
    async def completions(self, request: Request):
        arrival = time.monotonic()
        self.authorize(request)
        self.admission.check_request()
        req = oai.parse(oai.CompletionRequest, await self.read_json(request))
        model = self.check_model(req.model)
        params = self._for_model(model, oai.completion_params(req))
        prompts = oai.completion_prompts(req)
        return await self._serve(request, "cmpl", model, prompts, params, req, arrival,
                                 chat=False)

    async def chat(self, request: Request):
        arrival = time.monotonic()
        self.authorize(request)
        self.admission.check_request()
        req = oai.parse(oai.ChatRequest, await self.read_json(request))
        model = self.check_model(req.model)
        params = self._for_model(model, oai.chat_params(req, self._engine.config.max_model_len))
        messages = oai.chat_prompt(req)
        return await self._serve(request, "chatcmpl", model, [messages], params, req, arrival,
                                 chat=True)

    async def _serve(self, request, prefix, model, prompts, params, req, arrival, chat: bool):
        call = Call(self.admission, request, oresp.new_id(prefix), arrival)
        log.info("request %s: %s", call.rid,
                 prompts if self.settings.log_prompts else "(prompt not logged)")
        created = oresp.now()
        choices = oresp.choices_for(len(prompts), params.n, params.logprobs,
                                  req.return_token_ids)
        streaming = False
        try:
            try:
                await call.submit(prompts, params, req.priority)
            except InvalidRequestError as e:   # a response_format schema that does not compile
                raise oai.response_format_error(e) if req.response_format else e from None
            if not await call.started():
                return Response(status_code=499)   # nobody is listening
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                events = (self._chat_events if chat else self._completion_events)(
                    call, model, created, choices, include_usage)
                streaming = True
                return EventStream(events, call.close)
            while call.unfinished:
                out = await call.next()
                if out is None:
                    return Response(status_code=499)
                c = oresp.choice_of(choices, call.index[out.request_id], out)
                if c is not None:
                    c.add(out)
            build = oresp.chat_response if chat else oresp.completion_response
            return JSONResponse(build(call.rid, created, model, choices, self.token_text))
        finally:
            if not streaming:
                call.close()

    async def _completion_events(self, call: Call, model, created, choices, include_usage):
        async for chunk in failing_as_event(self._completion_chunks(
                call, model, created, choices, include_usage)):
            yield chunk

    async def _completion_chunks(self, call: Call, model, created, choices, include_usage):
        usage_field = {"usage": None} if include_usage else {}
        while call.unfinished:
            out = await call.next()
            if out is None:
                return
            c = oresp.choice_of(choices, call.index[out.request_id], out)
            if c is None:
                continue
            offset = len(c.text)
            new, dicts = c.add(out)
            tokens_due = new and (c.logprobs is not None or c.with_token_ids)
            if not (out.text_delta or c.finish_reason or tokens_due):
                continue
            lp = (oresp.completion_logprobs(new, dicts, c.logprobs, self.token_text, offset)
                  if c.logprobs is not None else None)
            choice = {"index": c.index, "text": out.text_delta, "logprobs": lp,
                      "finish_reason": c.finish_reason}
            if c.with_token_ids:
                choice["token_ids"] = new
            yield sse({"id": call.rid, "object": "text_completion", "created": created,
                        "model": model, "choices": [choice], **usage_field})
        if include_usage:
            yield sse({"id": call.rid, "object": "text_completion", "created": created,
                        "model": model, "choices": [], "usage": _total_usage(choices)})
        yield b"data: [DONE]\n\n"

    async def _chat_events(self, call: Call, model, created, choices, include_usage):
        async for chunk in failing_as_event(self._chat_chunks(
                call, model, created, choices, include_usage)):
            yield chunk

    async def _chat_chunks(self, call: Call, model, created, choices, include_usage):
        def chunk(index, delta, finish_reason=None, logprobs=None, token_ids=None):
            return sse(oresp.chat_chunk(call.rid, created, model, index, delta, finish_reason,
                                       logprobs, with_usage=include_usage, token_ids=token_ids))

        for c in choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        while call.unfinished:
            out = await call.next()
            if out is None:
                return
            c = oresp.choice_of(choices, call.index[out.request_id], out)
            if c is None:
                continue
            new, dicts = c.add(out)
            if out.text_delta or (new and (c.logprobs is not None or c.with_token_ids)):
                lp = (oresp.chat_logprobs(new, dicts, c.logprobs, self.token_text)
                      if c.logprobs is not None else None)
                yield chunk(c.index, {"content": out.text_delta}, logprobs=lp,
                            token_ids=new if c.with_token_ids else None)
            if c.finish_reason is not None:
                yield chunk(c.index, {}, c.finish_reason)
        if include_usage:
            yield sse(oresp.chat_chunk(call.rid, created, model, None, None,
                                      usage_=_total_usage(choices), with_usage=True))
        yield b"data: [DONE]\n\n"

    # --- the rest -----------------------------------------------------------------------
    def models(self, request: Request) -> dict:
        self.authorize(request)
        self.admission.check()
        return {"object": "list", "data": [self._model_card(m) for m in
                                           [self.model_name, *self._engine.lora_names()]]}

    def model(self, request: Request, model: str) -> dict:
        self.authorize(request)
        return self._model_card(self.check_model(model))

    def _model_card(self, model: str) -> dict:
        card = {"id": model, "object": "model", "created": oresp.now(), "owned_by": "jaxinfer",
                "max_model_len": self._engine.config.max_model_len}
        if model != self.model_name:     # a LoRA adapter, as vLLM lists one
            try:
                card.update(root=self._engine.lora_path(model), parent=self.model_name)
            except InvalidRequestError:      # unloaded meanwhile
                pass
        return card

    async def tokenize(self, request: Request) -> dict:
        self.authorize(request)
        req = oai.parse(oai.TokenizeRequest, await self.read_json(request))
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt, messages", field="prompt")
        if req.prompt is not None:
            ids = self._tokenizer("prompt").encode(req.prompt, req.add_special_tokens)
        else:
            tok = self._tokenizer("messages")
            ids = tok.encode(tok.apply_chat_template(oai.chat_messages(req.messages),
                                                     req.add_generation_prompt),
                             add_special_tokens=False)
        return {"count": len(ids), "max_model_len": self._engine.config.max_model_len,
                "tokens": ids}

    async def detokenize(self, request: Request) -> dict:
        self.authorize(request)
        req = oai.parse(oai.DetokenizeRequest, await self.read_json(request))
        self.check_model(req.model)
        vocab = self._engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"tokens holds ids outside the vocabulary [0, {vocab}): "
                                      f"{bad[:5]}", field="tokens")
        return {"prompt": self._tokenizer("tokens").decode(req.tokens)}

    def health(self) -> Response:
        return Response(status_code=200 if self.admission.ready else 503)

    def metrics(self, request: Request) -> Response:
        self.authorize(request)
        return Response(generate_latest(self.admission.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


def _total_usage(choices) -> dict:
    return oresp.usage(sum(c.prompt_tokens for c in choices),
                     sum(len(c.token_ids) for c in choices))


def build_app(admission: Admission, settings: HttpSettings) -> FastAPI:
    api = OpenAIApi(admission, settings)
    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
    app.add_api_route("/v1/load_lora_adapter", api.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e.status, str(e), e.param, e.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request, e: InvalidRequestError):
        return JSONResponse(oresp.invalid_request_body(e), status_code=400)

    @app.exception_handler(Refused)
    async def _refused(request, e: Refused):
        status, code = _REFUSED[e.reason]
        return error_response(status, str(e), None, code)

    @app.exception_handler(RequestFailed)
    async def _failed(request, e: RequestFailed):
        return error_response(500, str(e), None, "engine_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        log.error("bug serving %s", request.url.path, exc_info=e)
        return error_response(500, "internal error (see the server log)")

    return app


def metrics_app(registry, auth_token: str | None = None):
    """The metrics port's app: /metrics and nothing else (404); with `auth_token`, only for
    requests that carry it."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    expected = digest(f"Bearer {auth_token}") if auth_token else None

    @app.get("/metrics")
    def _metrics(request: Request):
        if expected is not None and not hmac.compare_digest(
                digest(request.headers.get("authorization", "")), expected):
            return error_response(401, "missing or wrong bearer token", code="invalid_api_key")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    return app
