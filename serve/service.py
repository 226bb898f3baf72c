"""The jaxinfer.v1.Inference service on grpc.aio: requests go to the engine thread, deltas come
back through a per-request asyncio queue and are streamed out as they arrive.

Status codes (no handler lets an exception escape as UNKNOWN):
  INVALID_ARGUMENT    bad sampling parameter, prompt, token id, UTF-8, request id, or bytes
                      that are no valid message (the details start with the field's name;
                      trailing metadata jaxinfer-field)
  RESOURCE_EXHAUSTED  the waiting queue is at its limit, or the engine predicts it cannot
                      finish the request within the call's deadline (jaxinfer/slo.py)
  UNAVAILABLE         still loading, draining for shutdown, or the engine failed for good
  FAILED_PRECONDITION a LoRA adapter load/unload when the server does not allow them (no
                      --allow-runtime-lora) or serves no adapters (max_loras 0)
  INTERNAL            the engine step running the request failed (other requests go on),
                      or a bug (logged with its traceback)
A client that cancels or passes its deadline has its request aborted in the engine. The
call's deadline is the request's: one the engine predicts it cannot meet is refused at once.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time

import grpc

from jaxinfer.errors import ConfigError, DeadlineError, InvalidRequestError
from serve import convert
from serve import jaxinfer_pb2 as pb
from serve import jaxinfer_pb2_grpc as pb_grpc
from serve.admission import Admission, Refused, RequestClock, RequestFailed, check_output

log = logging.getLogger("jaxinfer.serve")
FIELD_METADATA_KEY = "jaxinfer-field"


_REFUSED = {"loading": grpc.StatusCode.UNAVAILABLE, "draining": grpc.StatusCode.UNAVAILABLE,
            "failed": grpc.StatusCode.UNAVAILABLE, "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED}


class Malformed:
    """A request whose bytes are not the message its method takes (see add_to_server)."""

    def __init__(self, message_cls, error: Exception):
        self.message, self.error = message_cls.__name__, error


def _lenient(message_cls):
    """A request deserializer that never raises (gRPC would answer UNKNOWN): the handler
    answers INVALID_ARGUMENT instead."""
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as e:   # protobuf's DecodeError, and anything else parsing raises
            return Malformed(message_cls, e)
    return parse


def add_to_server(service: "InferenceService", server) -> None:
    """Register the Inference service (as the generated add_InferenceServicer_to_server
    does, with deserializers that let a malformed message reach the handler)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            service.ModelInfo, request_deserializer=_lenient(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfoResponse.SerializeToString),
        "LoadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
            service.LoadLoRAAdapter, request_deserializer=_lenient(pb.LoadLoRAAdapterRequest),
            response_serializer=pb.LoRAAdapters.SerializeToString),
        "UnloadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
            service.UnloadLoRAAdapter,
            request_deserializer=_lenient(pb.UnloadLoRAAdapterRequest),
            response_serializer=pb.LoRAAdapters.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Inference"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def guarded(handler):
    """Map every exception a handler raises to a deliberate status code."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise InvalidRequestError(f"the request is not a valid {request.message} "
                                          f"message ({request.error})", field="request")
            return await handler(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Refused as e:
            await context.abort(_REFUSED[e.reason], str(e))
        except RequestFailed as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except DeadlineError as e:
            self._metrics.refused.labels("deadline").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ConfigError as e:      # an engine setting that rules the call out
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except InvalidRequestError as e:
            field = e.field or "request"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e}",
                                trailing_metadata=((FIELD_METADATA_KEY, field),))
        except Exception:
            log.exception("bug in %s", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (see the server log)")

    return wrapper


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, admission: Admission, log_prompts: bool = False,
                 allow_runtime_lora: bool = False):
        self._admission, self._log_prompts = admission, log_prompts
        self._allow_runtime_lora = allow_runtime_lora
        self._engine, self._metrics = admission.engine, admission.metrics
        self._ids = itertools.count()

    @guarded
    async def ModelInfo(self, request, context):
        self._admission.check()
        return convert.model_info(self._engine.engine, self._engine.max_waiting)

    @guarded
    async def LoadLoRAAdapter(self, request, context):
        self._check_runtime_lora()
        adapter = await self._admission.off_engine(   # streams do not wait for the disk
            self._engine.engine.read_lora, request.lora_name, request.lora_path)
        return await self._on_engine(lambda engine: engine.add_lora(adapter))

    @guarded
    async def UnloadLoRAAdapter(self, request, context):
        return await self._on_engine(lambda engine: engine.unload_lora(request.lora_name))

    async def _on_engine(self, fn) -> pb.LoRAAdapters:
        """A LoRA load/unload on the engine thread; the adapters loaded after it."""
        self._check_runtime_lora()
        await asyncio.wrap_future(self._engine.call(fn))
        return pb.LoRAAdapters(lora_adapters=self._engine.engine.lora_names())

    def _check_runtime_lora(self) -> None:
        if not self._allow_runtime_lora:
            raise ConfigError("loading LoRA adapters at run time is off: start the server "
                              "with --allow-runtime-lora")
        self._admission.check()

    @guarded
    async def Generate(self, request, context):
        arrival = time.monotonic()
        self._admission.check_request()
        prompt = convert.prompt_from_proto(request)
        params = convert.sampling_from_proto(request.sampling)
        rid = convert.request_id_from_proto(request) or f"grpc-{next(self._ids)}"
        deltas = await self._admission.submit(rid, prompt, params, priority=request.priority,
                                              deadline=context.time_remaining())
        log.info("request %s: %s", rid, prompt if self._log_prompts else "(prompt not logged)")
        clock, finished = RequestClock(self._metrics, arrival), False
        try:
            finished = await self._stream(rid, deltas, clock, context)
        except asyncio.CancelledError:  # the client cancelled or passed its deadline
            clock.disconnected()
            raise
        finally:
            self._admission.release(rid, finished)  # unfinished: aborted, pages freed

    async def _stream(self, rid, deltas: asyncio.Queue, clock: RequestClock, context) -> bool:
        """Write each delta as it arrives; True once the last one (with usage) is written."""
        prompt_sent = False
        while True:
            out = await deltas.get()
            if isinstance(out, Exception):
                raise out
            now = clock.output(out)
            check_output(out)       # a failed step: INTERNAL
            resp = convert.response_from_output(out, prompt_logprobs=not prompt_sent)
            prompt_sent = prompt_sent or bool(resp.prompt_logprobs)
            if out.finished:
                resp.usage.CopyFrom(pb.Usage(
                    prompt_tokens=len(out.prompt_token_ids),
                    completion_tokens=sum(len(c.token_ids) for c in out.outputs),
                    ttft_ms=1e3 * ((clock.first or now) - clock.arrival),
                    e2e_ms=1e3 * (now - clock.arrival)))
            await context.write(resp)
            if out.finished:
                log.info("request %s: %s after %d tokens", rid, out.finish_reason,
                         len(out.token_ids))
                return True
