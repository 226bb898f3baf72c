"""A small Python client for the jaxinfer gRPC service.

    from serve.client import Client
    with Client("127.0.0.1:50051") as c:
        for r in c.generate("The capital of France is", {"max_tokens": 16, "temperature": 0}):
            print(r.text, end="", flush=True)
        done = c.complete([{"role": "user", "content": "Hi!"}], {"max_tokens": 32})
        done.text, done.token_ids, done.finish_reason, done.usage.ttft_ms

A prompt is text, a list of chat messages ({"role", "content"}), a list of token ids or
{"prompt_token_ids": [...]}. Sampling is a jaxinfer SamplingParams or a dict of its fields
(sent as they are: the server validates them).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.request import SamplingParams
from jaxinfer.structured_output import StructuredOutputsParams
from serve import jaxinfer_pb2 as pb
from serve.convert import structured_to_proto
from serve import jaxinfer_pb2_grpc as pb_grpc

_PROTO_FIELDS = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_CANCELLED: "cancelled"}


def _encode(s) -> bytes:
    return s if isinstance(s, bytes) else s.encode("utf-8")


def build_request(prompt, sampling=None, request_id: str | None = None,
                  priority: int = 0) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id or "", priority=priority)
    # SetInParent: an empty list is still sent as that kind of prompt (and rejected as empty).
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt["prompt_token_ids"])
    elif isinstance(prompt, (str, bytes)):
        req.text = _encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=_encode(m["content"]))
                                     for m in prompt)
    elif isinstance(prompt, (list, tuple)):
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt)
    elif prompt is not None:
        raise TypeError(f"unsupported prompt type {type(prompt).__name__}")
    fields = dataclasses.asdict(sampling) if dataclasses.is_dataclass(sampling) else (sampling or {})
    for name, value in fields.items():
        if value is None:
            continue
        if name not in _PROTO_FIELDS:   # a field the service does not take: its default only
            if name not in _DEFAULTS or value != _DEFAULTS[name]:
                raise ValueError(f"the gRPC service does not take {name} (got {value!r})")
            continue
        if name == "stop":
            req.sampling.stop.extend(_encode(s) for s in ([value] if isinstance(value, str)
                                                          else value))
        elif name == "stop_token_ids":
            req.sampling.stop_token_ids.extend(value)
        elif name == "lora":
            req.sampling.lora = _encode(value)
        elif name == "structured_outputs":
            structured_to_proto(dataclasses.asdict(StructuredOutputsParams.coerce(value)),
                                req.sampling.structured_outputs)
        else:
            setattr(req.sampling, name, value)
    return req


def channel_credentials(tls_ca: Path | bytes | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None:
        return None
    pem = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem)


def auth_metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


class NotReadyError(grpc.RpcError):
    """The health stream ended without SERVING (the server is shutting down)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: pb.Usage
    logprobs: list[pb.TokenLogprobs]
    request_id: str
    # n > 1: every completion by index (this object's own fields are completion 0's)
    completions: list["Completion"] | None = None
    # sampling.prompt_logprobs: one per prompt token (GenerateResponse.prompt_logprobs)
    prompt_logprobs: list[pb.TokenLogprobs] | None = None


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", *, token: str | None = None,
                 tls_ca: Path | bytes | None = None, max_message_bytes: int = 4 << 20,
                 tls_server_name: str | None = None):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        creds = channel_credentials(tls_ca)
        self.channel = (grpc.secure_channel(target, creds, options) if creds
                        else grpc.insecure_channel(target, options))
        self.stub = pb_grpc.InferenceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metadata = auth_metadata(token)

    def generate(self, prompt, sampling=None, *, request_id: str | None = None,
                 timeout: float | None = None, priority: int = 0
                 ) -> Iterator[pb.GenerateResponse]:
        """Stream the responses; cancel() on the returned iterator aborts the request.
        timeout: the call's deadline, which is also the request's (a request the server
        predicts it cannot finish in time is refused with RESOURCE_EXHAUSTED); priority:
        the server's queue takes lower values first."""
        return self.stub.Generate(build_request(prompt, sampling, request_id, priority),
                                  timeout=timeout, metadata=self._metadata)

    def complete(self, prompt, sampling=None, **kw) -> Completion:
        """Run a request to its end and join the streamed pieces (by completion index when
        it asked for n > 1: `completions`)."""
        parts: dict[int, tuple[list, list, list, list]] = {}
        last, prompt_lp = None, None
        for last in self.generate(prompt, sampling, **kw):
            prompt_lp = list(last.prompt_logprobs) or prompt_lp
            text, ids, logprobs, reason = parts.setdefault(last.index, ([], [], [], [None]))
            text.append(last.text)
            ids.extend(last.token_ids)
            logprobs.extend(last.logprobs)
            reason[0] = self.finish_reason(last) or reason[0]
        done = [Completion("".join(text), ids, reason[0], last.usage, logprobs, last.request_id)
                for _, (text, ids, logprobs, reason) in sorted(parts.items())]
        done[0].prompt_logprobs = prompt_lp
        if len(done) == 1:
            return done[0]
        return dataclasses.replace(done[0], completions=done)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout,
                                   metadata=self._metadata)

    def load_lora_adapter(self, name: str, path: str, timeout: float | None = None
                          ) -> list[str]:
        """Load the PEFT adapter at `path` (on the server's machine) as `name`; returns the
        adapters loaded after it. The server needs --allow-runtime-lora."""
        return list(self.stub.LoadLoRAAdapter(
            pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path)), timeout=timeout,
            metadata=self._metadata).lora_adapters)

    def unload_lora_adapter(self, name: str, timeout: float | None = None) -> list[str]:
        """Unload adapter `name`; returns the adapters still loaded."""
        return list(self.stub.UnloadLoRAAdapter(
            pb.UnloadLoRAAdapterRequest(lora_name=name), timeout=timeout,
            metadata=self._metadata).lora_adapters)

    def wait_until_ready(self, timeout: float | None = None, service: str = "") -> None:
        """Block until the server reports SERVING: through a port not open yet and a model
        still loading or compiling. Raises grpc.RpcError (DEADLINE_EXCEEDED after `timeout`
        seconds, or UNAVAILABLE when the server stops before it is ready)."""
        stream = self._health.Watch(health_pb2.HealthCheckRequest(service=service),
                                    timeout=timeout, wait_for_ready=True)
        try:
            for resp in stream:
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        finally:
            stream.cancel()
        raise NotReadyError("the server stopped before it was ready")

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """'SERVING', 'NOT_SERVING', ... (the grpc.health.v1 status name)."""
        resp = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    @staticmethod
    def finish_reason(resp: pb.GenerateResponse) -> str | None:
        return FINISH_REASONS.get(resp.finish_reason)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
