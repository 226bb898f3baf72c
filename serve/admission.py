"""What the front ends (gRPC, HTTP) share on the asyncio loop: whether requests are taken
(loading, draining, queue full), the requests in flight, and each one's stream of outputs
from the engine thread.

    admission.check()                         # Refused while loading or draining
    deltas = await admission.submit(rid, prompt, params)  # a Queue of RequestOutput | Exception
    ...
    admission.release(rid, finished)          # not finished: aborted, its pages freed

The drain on SIGTERM waits for `idle` (no request in flight on any front end).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time

from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import FinishReason
from jaxinfer.engine_thread import EngineThread, LoopSink
from serve.metrics import Metrics


class Refused(Exception):
    """A request the server does not take now: `reason` is loading, draining, failed (the
    engine is dead; the process is exiting) or queue_full."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Admission:
    def __init__(self, engine: EngineThread, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._pool = concurrent.futures.ThreadPoolExecutor(
            min(4, os.cpu_count() or 1), thread_name_prefix="tokenize")
        self.draining = False
        self._active: set[str] = set()
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def ready(self) -> bool:
        """Loaded, warm and not draining: what health checks report."""
        return (self.engine.ready.is_set() and self.engine.error is None
                and self.engine.alive and not self.draining)

    def check(self) -> None:
        if self.draining:
            raise Refused("draining", "the server is shutting down")
        if self.engine.error is not None:
            raise Refused("failed", "the engine failed; the server is restarting")
        if not self.engine.ready.is_set():
            raise Refused("loading", "the model is still loading")

    def check_request(self) -> None:
        """check() for a request to generate: a refusal counts in
        jaxinfer_requests_refused_total."""
        try:
            self.check()
        except Refused as e:
            self.metrics.refused.labels(e.reason).inc()
            raise

    async def off_engine(self, fn, *args):
        """fn(*args) on the tokenizer pool: work that must stall neither the engine's thread
        nor the event loop (reading a LoRA adapter from disk)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def submit(self, rid: str, prompt, params, deltas: asyncio.Queue | None = None,
                     priority: int = 0, deadline: float | None = None) -> asyncio.Queue:
        """Validate and tokenize a request off the engine thread (on a small pool: a long
        prompt delays no one's tokens), then hand it to the engine thread; its outputs (and
        an exception, if it fails) arrive on `deltas` (default: a new queue), which is
        returned. Several requests may share one queue (RequestOutput.request_id tells them
        apart). priority: the queue takes lower values first; deadline: seconds from now by
        which it must finish (a DeadlineError arrives on `deltas` when the engine predicts
        it cannot). Raises Refused or
        InvalidRequestError."""
        t0 = time.monotonic()
        self.check_request()
        if rid in self._active:
            raise InvalidRequestError(f"request id {rid!r} is already in use", field="request_id")
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._pool, self.engine.engine.encode_prompt, prompt,
                                         params)
        self.check_request()            # it may have started draining meanwhile
        if rid in self._active:
            raise InvalidRequestError(f"request id {rid!r} is already in use", field="request_id")
        prompt = {"prompt_token_ids": ids}
        deltas = asyncio.Queue() if deltas is None else deltas
        if deadline is not None:
            deadline -= time.monotonic() - t0       # the time tokenizing took
        if not self.engine.submit(rid, prompt, params, LoopSink(loop, deltas.put_nowait),
                                  priority=priority, deadline=deadline):
            self.metrics.refused.labels("queue_full").inc()
            raise Refused("queue_full", f"the waiting queue is full "
                                        f"({self.engine.max_waiting} requests); retry later")
        self._active.add(rid)
        self.idle.clear()
        return deltas

    def release(self, rid: str, finished: bool) -> None:
        """The front end is done with a request; an unfinished one is aborted in the engine
        (its pages are free for the next step). Idempotent."""
        if rid not in self._active:
            return
        self._active.discard(rid)
        if not self._active:
            self.idle.set()
        if not finished:
            self.engine.abort(rid)

    def abort_all(self) -> None:
        """End every in-flight request now; each gets a final `cancelled` output."""
        for rid in list(self._active):
            self.engine.abort(rid, notify=True)


class RequestFailed(Exception):
    """The engine step running a request failed (FinishReason.ERROR); others go on."""

    def __init__(self, out):
        super().__init__(f"the engine step running this request failed ({out.error}); "
                         f"retry it")


def check_output(out):
    """An output from the engine thread: RequestFailed for a failed request, else `out`."""
    if out.finish_reason == FinishReason.ERROR:
        raise RequestFailed(out)
    return out


class RequestClock:
    """One request's latency metrics (TTFT, inter-token, end-to-end, outcome) as its outputs
    reach the front end."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.first = self.last = None

    def output(self, out) -> float:
        """Observe one output; returns now."""
        now, m = time.monotonic(), self.metrics
        if out.new_token_ids:
            if self.first is None:
                self.first = now
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last)
            self.last = now
        if out.finished:
            m.e2e.observe(now - self.arrival)
            m.requests.labels(str(out.finish_reason)).inc()
        return now

    def disconnected(self) -> None:
        self.metrics.requests.labels("disconnected").inc()
