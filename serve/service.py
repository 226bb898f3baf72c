"""The jaxinfer.v1.Inference service on grpc.aio: requests go to the engine thread, deltas come
back through a per-request asyncio queue and are streamed out as they arrive.

Status codes (no handler lets an exception escape as UNKNOWN):
  INVALID_ARGUMENT    bad sampling parameter, prompt, token id, UTF-8, request id (the
                      details start with the field's name; trailing metadata jaxinfer-field)
  RESOURCE_EXHAUSTED  the waiting queue is at its limit
  UNAVAILABLE         still loading, or draining for shutdown
  INTERNAL            a bug (logged with its traceback)
A client that cancels or passes its deadline has its request aborted in the engine.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time

import grpc

from jaxinfer.errors import InvalidRequestError
from serve import convert
from serve import jaxinfer_pb2 as pb
from serve import jaxinfer_pb2_grpc as pb_grpc
from serve.engine_thread import EngineThread
from serve.metrics import Metrics

log = logging.getLogger("jaxinfer.serve")
FIELD_METADATA_KEY = "jaxinfer-field"


class Rejected(Exception):
    """A request refused with a status code other than INVALID_ARGUMENT."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


def guarded(handler):
    """Map every exception a handler raises to a deliberate status code."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Rejected as e:
            await context.abort(e.code, e.details)
        except InvalidRequestError as e:
            field = e.field or "request"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {e}",
                                trailing_metadata=((FIELD_METADATA_KEY, field),))
        except Exception:
            log.exception("bug in %s", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (see the server log)")

    return wrapper


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, engine: EngineThread, metrics: Metrics, log_prompts: bool = False):
        self._engine, self._metrics, self._log_prompts = engine, metrics, log_prompts
        self._active: set[str] = set()
        self._ids = itertools.count()
        self.draining = False
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()

    @property
    def num_active(self) -> int:
        return len(self._active)

    def _check_serving(self) -> None:
        if self.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not self._engine.ready.is_set() or self._engine.error is not None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    @guarded
    async def ModelInfo(self, request, context):
        self._check_serving()
        return convert.model_info(self._engine.engine, self._engine.max_waiting)

    @guarded
    async def Generate(self, request, context):
        arrival = time.monotonic()
        self._check_serving()
        prompt = convert.prompt_from_proto(request)
        params = convert.sampling_from_proto(request.sampling)
        rid = convert.request_id_from_proto(request) or f"grpc-{next(self._ids)}"
        if rid in self._active:
            raise InvalidRequestError(f"request id {rid!r} is already in use", field="request_id")
        loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
        if not self._engine.submit(rid, prompt, params,
                                   lambda item: loop.call_soon_threadsafe(deltas.put_nowait, item)):
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the waiting queue is full ({self._engine.max_waiting} requests); "
                           f"retry later")
        self._active.add(rid)
        self.idle.clear()
        log.info("request %s: %s", rid, prompt if self._log_prompts else "(prompt not logged)")
        finished = False
        try:
            finished = await self._stream(rid, deltas, arrival, context)
        except asyncio.CancelledError:  # the client cancelled or passed its deadline
            self._metrics.requests.labels("disconnected").inc()
            raise
        finally:
            self._active.discard(rid)
            if not self._active:
                self.idle.set()
            if not finished:
                self._engine.abort(rid)  # its pages are free for the next step

    async def _stream(self, rid, deltas: asyncio.Queue, arrival: float, context) -> bool:
        """Write each delta as it arrives; True once the last one (with usage) is written."""
        first = last = None
        while True:
            out = await deltas.get()
            if isinstance(out, Exception):
                raise out
            now = time.monotonic()
            if out.new_token_ids:
                if first is None:
                    first = now
                    self._metrics.ttft.observe(now - arrival)
                else:
                    self._metrics.itl.observe(now - last)
                last = now
            resp = convert.response_from_output(out)
            if out.finished:
                resp.usage.CopyFrom(self._usage(out, arrival, first, now))
                self._metrics.e2e.observe(now - arrival)
                self._metrics.requests.labels(str(out.finish_reason)).inc()
            await context.write(resp)
            if out.finished:
                log.info("request %s: %s after %d tokens", rid, out.finish_reason,
                         len(out.token_ids))
                return True

    @staticmethod
    def _usage(out, arrival, first, now) -> pb.Usage:
        return pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=len(out.token_ids),
                        ttft_ms=1e3 * ((first or now) - arrival), e2e_ms=1e3 * (now - arrival))

    def abort_all(self) -> None:
        """End every in-flight request now; each gets a final `cancelled` response."""
        for rid in list(self._active):
            self._engine.abort(rid, notify=True)
