"""The device time of each step, from the host's own clock, under async scheduling too.

Wall time per step is not device time: with async scheduling the host waits for step k only
after it has dispatched step k+1, so `step wall - host work` is the wait alone. The device
runs the steps in order on one stream, so a step's device time is

    ready(k) - max(ready(k-1), enqueued(k))

where enqueued(k) is when the host finished dispatching step k and ready(k) when its outputs
became ready. The host knows ready(k) exactly when it blocked on the outputs (they were not
ready when it looked): the moment the wait ends. When they were ready already, ready(k) is
unknown and so is the step's device time; ready(k-1) unknown still bounds it when the host
looked at step k-1 before it enqueued step k (then step k-1 ended before step k could
start). A steady, device-bound engine blocks on every step, so every step is measured.
Other programs enqueued between two steps (a page copy, a LoRA slot write) count in the
step after them.
"""
from __future__ import annotations

import dataclasses
import time

import jax


@dataclasses.dataclass(frozen=True)
class StepTimes:
    enqueued: float | None    # the host finished dispatching it (None: unknown)
    ready: float | None       # its outputs became ready (None: they were before `looked`)
    looked: float             # the host began to wait for it


def device_seconds(prev: StepTimes | None, cur: StepTimes) -> float | None:
    """The device time of step `cur` after step `prev` (None: the first step), or None
    where the timestamps cannot tell it (module docstring)."""
    if cur.ready is None or cur.enqueued is None:
        return None
    start = cur.enqueued
    if prev is not None:
        if prev.ready is not None:
            start = max(start, prev.ready)
        elif prev.looked > cur.enqueued:
            return None      # step k-1 ended at an unknown time, maybe after step k began
    return max(cur.ready - start, 0.0)


class DeviceClock:
    """Waits for each step's outputs in step order and times them (device_seconds)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._prev: StepTimes | None = None

    def wait(self, outputs, enqueued: float | None) -> float | None:
        """Block until `outputs` (a pytree of arrays: one step's) are ready; that step's
        device seconds, or None where unknown."""
        looked = self.clock()
        leaves = [x for x in jax.tree_util.tree_leaves(outputs) if isinstance(x, jax.Array)]
        already = all(x.is_ready() for x in leaves)
        jax.block_until_ready(leaves)
        cur = StepTimes(enqueued, None if already else self.clock(), looked)
        seconds, self._prev = device_seconds(self._prev, cur), cur
        return seconds

    def reset(self) -> None:
        """Forget the previous step (after a failed step, whose outputs were never read)."""
        self._prev = None
