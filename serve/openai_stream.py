"""One HTTP request of the OpenAI API in flight: its engine requests (one per prompt) with
their merged outputs and the client's disconnect (Call), and the server-sent event stream
that writes them (EventStream)."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from serve.admission import Admission, RequestClock, RequestFailed, check_output

_GONE = object()   # put on a request's queue when its client disconnects


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response over an async generator of chunks; `on_close` runs however
    it ends (finished, client gone, server stopping). The generator itself notices a client
    that disconnects (Call watches for it), so the response does not listen as well."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._events, self._on_close = events, on_close

    async def __call__(self, scope, receive, send):
        try:
            await self.stream_response(send)
        finally:
            await self._events.aclose()
            self._on_close()


class Call:
    """One HTTP request's engine requests (one per prompt) and their merged outputs."""

    def __init__(self, admission: Admission, request: Request, rid: str, arrival: float):
        self.admission, self.request, self.rid, self.arrival = admission, request, rid, arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict[str, int] = {}          # engine request id -> choice index
        self.clocks: dict[str, RequestClock] = {}
        self.unfinished: set[str] = set()
        self.early: list = []                    # outputs read before the response started
        self._watch = None

    async def submit(self, prompts, params, priority: int = 0) -> None:
        for i, prompt in enumerate(prompts):
            erid = self.rid if len(prompts) == 1 else f"{self.rid}-{i}"
            await self.admission.submit(erid, prompt, params, self.queue, priority=priority)
            self.index[erid] = i
            self.clocks[erid] = RequestClock(self.admission.metrics, self.arrival)
            self.unfinished.add(erid)
        self._watch = asyncio.ensure_future(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait(_GONE)

    async def next(self):
        """The next output (an exception is raised); None once the client is gone."""
        item = self.early.pop(0) if self.early else await self.queue.get()
        if item is _GONE:
            self._gone()
            return None
        if isinstance(item, Exception):
            raise item
        self.clocks[item.request_id].output(item)
        if item.finished:
            self.unfinished.discard(item.request_id)
        return check_output(item)

    async def started(self) -> bool:
        """Wait until every prompt has its first output (or the client is gone: False)."""
        seen: set[str] = set()
        while len(seen) < len(self.index):
            item = await self.queue.get()
            if item is _GONE:
                self._gone()
                return False
            if isinstance(item, Exception):
                raise item
            seen.add(item.request_id)
            self.early.append(item)
            if item.finished:          # failed at once: answer with the error status
                check_output(item)
        return True

    def _gone(self) -> None:
        """The client disconnected: its unfinished requests count as such (close aborts
        them)."""
        for erid in self.unfinished:
            self.clocks[erid].disconnected()

    def close(self) -> None:
        """Abort what has not finished (its pages freed) and stop watching the client."""
        for erid in self.index:
            self.admission.release(erid, finished=erid not in self.unfinished)
        if self._watch is not None:
            self._watch.cancel()


async def failing_as_event(chunks):
    """A stream's chunks; a request that fails mid-stream (its status is sent already) ends
    with an error event in OpenAI's shape, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except RequestFailed as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None,
                              "code": "engine_error"}})
        yield b"data: [DONE]\n\n"
