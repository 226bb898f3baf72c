"""Steps dispatched from a thread of their own, so the host runs ahead of a blocking dispatch.

On the GPU an XLA conditional (the lax.conds of the `full` and `prompt` sampling variants,
sampling.py) copies its predicate to the host, and the call that dispatched the step returns
only once the step's forward pass is done. Dispatched from the engine's thread, that leaves
the host nothing to overlap: it would prepare step t+1 and read step t only after step t's
forward pass. ModelRunner.submit hands every step to a DispatchThread instead and returns
Pending outputs at once: a `plain` step (greedy, without a conditional) does not block, but
its launch still takes ~1-2 ms of host time a step on the GPU (the arguments' handling and
PJRT's execute, which releases the GIL), which the hand-over takes off the engine's thread,
as it does the packing of the step's host input and its transfer (ModelRunner.prepare). The
engine reports the thread's time per step beside its own (`Engine.last_phases`).
The engine prepares the next step and turns the last one's tokens into text while the thread
dispatches and waits on the device, and waits for the thread (ModelRunner.sync) only when it
dispatches again.

Calls run one at a time in the order they were handed over; what a call raised is raised by
each `Pending.get()` of its outputs and, once, by the next `wait()`.
"""
from __future__ import annotations

import concurrent.futures
import time


class Pending:
    """One output of a call on the dispatch thread: `get()` waits for it."""

    def __init__(self, future: concurrent.futures.Future, index: int, shape=None):
        self._future, self._index = future, index
        self.shape = shape       # known ahead (PackedInput.signature reads it)

    def get(self):
        return self._future.result()[self._index]


def timed(fn, *args):
    """fn(*args)'s outputs (a tuple), then when it returned: a dispatch's enqueue time
    (device_clock.py)."""
    return (*fn(*args), time.perf_counter())


def resolve(x):
    """`x`, or what it stands for when it is Pending (waiting for it)."""
    return x.get() if isinstance(x, Pending) else x


class DispatchThread:
    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="jaxinfer-dispatch")
        self._last: concurrent.futures.Future | None = None
        self.busy_seconds = 0.0     # spent in the calls so far (on the thread)

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the thread after every call handed over before it."""
        self._last = self._pool.submit(self._run, fn, *args)
        return self._last

    def _run(self, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_seconds += time.perf_counter() - t

    def wait(self, raise_errors: bool = True) -> None:
        """Until the last call handed over has returned; raise_errors: raise what it raised
        (once)."""
        last, self._last = self._last, None
        if last is None:
            return
        concurrent.futures.wait([last])
        if raise_errors and last.exception() is not None:
            raise last.exception()
