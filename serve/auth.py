"""Bearer-token authentication as a server interceptor.

Clients send metadata `authorization: Bearer <token>`. The comparison is constant-time over
SHA-256 digests (equal lengths, so not even the token's length leaks). The health service
stays open: load balancers and orchestrators probe it without credentials.
"""
from __future__ import annotations

import hashlib
import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def digest(value: str) -> bytes:
    """What is compared: SHA-256 of the header value (the HTTP API compares the same way)."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("the auth token is empty")
        self._expected = digest(f"Bearer {token}")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(sent, bytes):
            sent = sent.decode("latin-1")
        if hmac.compare_digest(digest(sent), self._expected):
            return handler
        return _denied(handler)


async def _deny(request_or_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token (send metadata 'authorization: "
                        "Bearer <token>')")


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary/stream in and out) that only says UNAUTHENTICATED."""
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](
        _deny, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)
