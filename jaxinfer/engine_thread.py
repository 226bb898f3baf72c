"""The one thread that owns the Engine (which is not thread-safe).

Other threads talk to it through a queue of commands (add, abort, stop) and get results back
through each request's `sink`, a thread-safe callable (the servers and AsyncLLM pass one that
hops onto their asyncio loop). The thread applies every pending command before each step, so
an aborted request's pages are free for the very next step.

"Waiting" here means handed in and not yet scheduled by any step: commands still in the queue
plus requests the scheduler has not admitted. That count, bounded by `max_waiting`, is what
`submit` refuses on (the servers answer RESOURCE_EXHAUSTED / 429, AsyncLLM QueueFullError).

Under load the thread's time is the step rate's ceiling, and Engine.step is only part of it:
`seconds` sums where it went (THREAD_PARTS), for the servers' metrics.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable

from jaxinfer.errors import DeadlineError, InvalidRequestError
from jaxinfer.request import RequestStatus

log = logging.getLogger("jaxinfer.serve")
Sink = Callable[[object], None]  # receives RequestOutput | Exception, from the engine thread
# Where the engine thread's time goes (EngineThread.seconds): waiting for a command with
# nothing to run, applying commands (adding, aborting requests), Engine.step, handing its
# outputs to their sinks (with the bookkeeping of admitted requests), the step observer.
THREAD_PARTS = ("idle", "commands", "step", "deliver", "observe")


class LoopSink:
    """A sink that hands each item to `put` on asyncio loop `loop` (put: e.g. an
    asyncio.Queue's put_nowait). The engine thread delivers a step's outputs for all the
    LoopSinks of one loop in one call_soon_threadsafe, not one each: one wake-up of the loop
    a step instead of one a request, and ~0.5 instead of ~8 us of the engine thread's time
    per output."""

    __slots__ = ("loop", "put")

    def __init__(self, loop, put: Callable[[object], None]):
        self.loop, self.put = loop, put

    def __call__(self, item) -> None:
        self.loop.call_soon_threadsafe(self.put, item)


class EngineThread:
    # Hand a step's outputs to their sinks when the next step first waits for the device
    # (Engine.step's on_wait) rather than as soon as the step returns: the receiving
    # threads (asyncio loops writing the streams) then run while this thread waits, instead
    # of taking the GIL while it schedules and dispatches the next step. Each output arrives
    # later by that step's host part. The last step before the engine idles delivers at once.
    # On by default: serving an 8B model, it cut the host's share of a step from about a half
    # to a third (docs/performance.md); False hands each step's outputs out at once.
    deliver_at_wait = True

    def __init__(self, make_engine: Callable[[], object], max_waiting: int,
                 on_ready: Callable[[object], object] | None = None,
                 on_exit: Callable[[], None] | None = None):
        """`make_engine` loads (and warms up) the engine on this thread; `on_ready(engine)`
        runs next, on this thread, and returns a step observer (`after_step(outputs,
        num_waiting, seconds)`, `seconds` this thread's time account so far).
        `on_exit()` runs on this thread when it ends (stopped, or the engine failed beyond
        recovery: then `error` is set)."""
        self._make_engine, self._on_ready, self._on_exit = make_engine, on_ready, on_exit
        self.max_waiting = max_waiting
        self.engine = None
        self.ready = threading.Event()     # set once the engine is loaded (or failed to)
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_waiting = 0              # guarded by _lock
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._waiting: dict[str, float] = {}  # engine thread only: id -> submit time
        self._observer = None
        # seconds spent per THREAD_PARTS since the engine was ready (engine thread only)
        self.seconds = dict.fromkeys(THREAD_PARTS, 0.0)
        self._held: list = []   # the last step's outputs, not yet delivered (deliver_at_wait)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # --- any thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def submit(self, request_id: str, prompt, params, sink: Sink, priority: int = 0,
               deadline: float | None = None) -> bool:
        """Hand a request in; False (and nothing queued) when the waiting queue is full.
        priority and deadline as Engine.add_request's (deadline: seconds from now); a request
        the engine predicts late, or whose deadline passes before the engine takes it, gets
        DeadlineError on its sink."""
        with self._lock:
            if self._num_waiting >= self.max_waiting:
                return False
            self._num_waiting += 1
        self._inbox.put(("add", request_id, prompt, params, sink, time.monotonic(), priority,
                         deadline))
        return True

    def abort(self, request_id: str, notify: bool = False) -> None:
        """Cancel a request; with notify its sink gets the final (cancelled) output."""
        self._inbox.put(("abort", request_id, notify))

    def call(self, fn: Callable[[object], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread, between steps (e.g. loading a LoRA adapter);
        the future gets its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        return future

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            try:
                self.engine = self._make_engine()
                self._observer = self._on_ready(self.engine) if self._on_ready else None
            except BaseException as e:  # reported by whoever waits on `ready`
                self.error = e
                self.ready.set()
                return
            self.ready.set()
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    if not self._step():
                        return
                elif self._observer is not None:  # idle after aborts: show the freed pages
                    self._observer.gauges(self._num_waiting)
        finally:
            self._deliver_held()
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except RuntimeError:  # the receiving loop is closed: nothing waits any more
                    pass

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if `block`); False on stop."""
        seconds, clock = self.seconds, time.perf_counter
        t0 = clock()
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
            t1 = clock()
            seconds["idle"] += t1 - t0
            t0 = t1
            while True:
                if cmd[0] == "stop":
                    return False
                getattr(self, "_" + cmd[0])(*cmd[1:])
                cmd = self._inbox.get_nowait()
        except queue.Empty:
            return True
        finally:
            seconds["commands"] += clock() - t0

    def _add(self, request_id, prompt, params, sink, submitted, priority, deadline) -> None:
        try:
            if deadline is not None:
                deadline -= time.monotonic() - submitted
                if deadline <= 0:
                    raise DeadlineError("the request's deadline passed before the engine "
                                        "took it")
            self.engine.add_request(prompt, params, request_id, priority=priority,
                                    deadline=deadline)
        except Exception as e:  # InvalidRequestError, or a bug the handler reports as INTERNAL
            self._unwait(1)
            if not isinstance(e, (InvalidRequestError, DeadlineError)):
                log.exception("add_request failed for %s", request_id)
            _deliver(sink, e)
            return
        self._sinks[request_id] = sink
        self._waiting[request_id] = submitted

    def _call(self, fn, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(self.engine))
        except Exception as e:     # the caller reports it
            future.set_exception(e)

    def _abort(self, request_id, notify) -> None:
        self._deliver_held()     # what the request produced before its abort comes first
        out = self.engine.abort_request(request_id)
        if self._waiting.pop(request_id, None) is not None:
            self._unwait(1)
        sink = self._sinks.pop(request_id, None)
        if notify and sink and out is not None:
            _deliver(sink, out)

    def _step(self) -> bool:
        """One engine step, its outputs delivered; False when the engine is dead (a step
        failed and recovery failed too: Engine.step): every request fails, `error` is set."""
        seconds, clock = self.seconds, time.perf_counter
        t0, delivering = clock(), seconds["deliver"]
        try:
            outputs = self.engine.step(on_wait=self._deliver_held if self._held else None)
        except Exception as e:
            log.critical("the engine failed beyond recovery; failing its %d requests",
                         len(self._sinks), exc_info=e)
            self.error = e
            self._fail_all(e)
            return False
        t1 = clock()
        seconds["step"] += t1 - t0 - (seconds["deliver"] - delivering)
        self._note_admitted()
        seconds["deliver"] += clock() - t1
        if self.deliver_at_wait and self.engine.has_unfinished_requests():
            self._held = outputs
        else:
            self._deliver(outputs)
        t2 = clock()
        if self._observer is not None:
            self._observer.after_step(outputs, self._num_waiting, seconds)
            seconds["observe"] += clock() - t2
        return True

    def _deliver_held(self) -> None:
        held, self._held = self._held, []
        if held:
            self._deliver(held)

    def _deliver(self, outputs) -> None:
        """A step's outputs to their sinks: the LoopSinks' in one call_soon_threadsafe per
        loop. Never raises (a failure is logged)."""
        t0 = time.perf_counter()
        try:
            by_loop: dict[object, list] = {}
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if out.finished:
                    self._sinks.pop(out.request_id, None)
                if type(sink) is LoopSink:
                    by_loop.setdefault(sink.loop, []).append((sink.put, out))
                elif sink is not None:
                    _deliver(sink, out)
            for loop, items in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:  # the receiving loop is closed: the server is stopping
                    pass
        except Exception:
            log.exception("delivering a step's outputs failed")
        self.seconds["deliver"] += time.perf_counter() - t0

    def _note_admitted(self) -> None:
        """Requests a step has scheduled stop counting as waiting; their queue time ends."""
        requests, now = self.engine.scheduler.requests, time.monotonic()
        admitted = [rid for rid in self._waiting
                    if rid not in requests or requests[rid].status != RequestStatus.WAITING]
        for rid in admitted:
            queued = now - self._waiting.pop(rid)
            if self._observer is not None:
                self._observer.queue_time(queued)
        self._unwait(len(admitted))

    def _fail_all(self, error: Exception) -> None:
        self._deliver_held()
        for rid, sink in list(self._sinks.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine may be broken; the request fails either way
                pass
            _deliver(sink, error)
        self._unwait(len(self._waiting))
        self._sinks.clear()
        self._waiting.clear()

    def _unwait(self, n: int) -> None:
        with self._lock:
            self._num_waiting -= n


def _put_all(items) -> None:
    """On the receiving loop: each (put, item) of one step, in order; one that raises does
    not keep the others from theirs."""
    for put, item in items:
        try:
            put(item)
        except Exception:
            log.exception("delivering an output failed")


def _deliver(sink: Sink, item) -> None:
    try:
        sink(item)
    except RuntimeError:  # the receiving loop is closed: the server is shutting down
        pass
