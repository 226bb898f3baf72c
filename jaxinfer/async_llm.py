"""Streaming from Python, in the style of vLLM's `AsyncLLM.generate`:

    from jaxinfer import AsyncLLM, SamplingParams

    async def main():
        with AsyncLLM("smollm2") as llm:
            async for out in llm.generate("The capital of France is",
                                          SamplingParams(max_tokens=16)):
                print(out.text_delta, end="", flush=True)

The engine runs on a thread of its own (jaxinfer.engine_thread), stepping whenever a request
is unfinished; each `generate` is an async generator of that request's outputs (deltas in
`new_token_ids` / `text_delta`, the text so far in `text`; the last has `finish_reason`). Any
number of generators may run at once on one event loop, and their requests are batched
together. Leaving a generator early (break, an exception, a cancelled task) aborts its
request and frees its pages. A request with n > 1 yields each completion's deltas as they
come (`outputs[0].index` says which) and then one final output holding all n.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.engine_thread import EngineThread, LoopSink
from jaxinfer.errors import EngineDeadError, QueueFullError
from jaxinfer.request import RequestOutput, SamplingParams


class AsyncLLM:
    def __init__(self, model: str = "smollm2", *, engine_config: EngineConfig | None = None,
                 max_waiting: int = 1 << 20, lora_modules=(), **engine_kwargs):
        """Load the model (and compile every bucket) on the engine thread; returns once it is
        ready to serve. `max_waiting`: requests handed in and not yet scheduled beyond which
        `generate` raises QueueFullError. lora_modules: (name, PEFT directory) pairs of LoRA
        adapters to serve from the start (needs max_loras > 0)."""
        cfg = engine_config or EngineConfig()
        if engine_kwargs:
            cfg = cfg.replace(**engine_kwargs)

        def make():
            engine = Engine.from_model(model, cfg, lora_modules)
            if engine.config.warmup:
                engine.warmup(progress=True)
            return engine

        self._thread = EngineThread(make, max_waiting)
        self._ids = itertools.count()
        self._thread.start()
        self._thread.ready.wait()
        if self._thread.error is not None:
            raise self._thread.error

    @property
    def engine(self) -> Engine:
        """The engine (read-only use from other threads: it is not thread-safe)."""
        return self._thread.engine

    async def generate(self, prompt, sampling_params: SamplingParams | dict | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """The outputs of one request as they come (see the module doc). An invalid prompt
        or parameter raises InvalidRequestError (naming the field) from the first step of
        the iteration; a dead engine raises EngineDeadError. priority and deadline as
        Engine.add_request's: a request the engine predicts it cannot finish by its
        deadline raises DeadlineError from the first step."""
        if not self._thread.alive:
            raise EngineDeadError("the engine thread has stopped")
        params = SamplingParams() if sampling_params is None else SamplingParams.coerce(
            sampling_params)
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        if not self._thread.submit(rid, prompt, params, LoopSink(loop, outputs.put_nowait),
                                   priority=priority, deadline=deadline):
            raise QueueFullError(f"{self._thread.max_waiting} requests are waiting already")
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._thread.abort(rid)

    async def load_lora(self, name: str, path) -> None:
        """Serve the PEFT adapter in directory `path` as `name` (Engine.load_lora), loaded on
        the engine thread between steps."""
        await asyncio.wrap_future(self._thread.call(lambda e: e.load_lora(name, path)))

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (Engine.unload_lora)."""
        await asyncio.wrap_future(self._thread.call(lambda e: e.unload_lora(name)))

    def abort(self, request_id: str) -> None:
        """Cancel a request by id: its generator yields the cancelled final output (text so
        far, finish_reason "cancelled") and ends."""
        self._thread.abort(request_id, notify=True)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests in flight are dropped)."""
        self._thread.stop(timeout)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
