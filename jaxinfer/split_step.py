"""Steps that run as two programs (step_program.splits: the `full` variant without prompt
targets, not a verify step), the forward pass and then the sampling, and the two submits that
let a grammar's token bitmask (structured output) be filled while the forward pass runs:
`submit_forward` dispatches the forward pass, `submit_sample` the sampling with the bitmask;
together they return what ModelRunner.submit returns. The forward pass writes into its own
persistent buffers, which the sampling reads before the next forward pass of that signature
overwrites them.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from jaxinfer.dispatch_thread import Pending, resolve, timed
from jaxinfer.step_input import PackedInput, StepInput
from jaxinfer.step_program import sample_signature, splits


@dataclasses.dataclass
class SplitStep:
    """A split step whose forward pass is dispatched and whose sampling is not
    (ModelRunner.submit_forward)."""

    packed: PackedInput
    step_index: int
    forward: object      # (logits, SamplingArrays) on the device, or Pending


class SplitSteps:
    """ModelRunner's split steps (a mixin: it uses the runner's cache, buffers, executables
    and dispatch thread)."""

    def submit_forward(self, inp: StepInput | PackedInput) -> SplitStep:
        """Dispatch the forward pass of a split step (step_program.splits) without its
        sampling, whose token bitmask the caller fills meanwhile and hands to
        `submit_sample`; the input's own bitmask only fixes the shape. One process only
        (the followers of several repeat whole steps)."""
        if self.mirror is not None:
            raise RuntimeError("a step is split between two submits on one process only")
        p = self.prepare(inp)
        if not splits(p.spec):
            raise ValueError("submit_forward: the step is not split (a `full` step without "
                             "prompt targets that verifies nothing)")
        self._num_steps += 1
        if self.fault_hook is not None:
            self.fault_hook("dispatch", self)
        if self._thread is None:
            self.sync()
            forward = self._dispatch_forward(p)[0]
        else:            # behind the step before's sampling, which blocks the thread
            forward = Pending(self._thread.call(self._dispatch_forward, p), 0)
        return SplitStep(p, self._num_steps, forward)

    def submit_sample(self, step: SplitStep, bitmask):
        """Dispatch the sampling of `step` (submit_forward) with `bitmask` [B, ceil(V/32)]
        i32 (numpy or on the device); returns what `submit` returns and sets last_enqueued."""
        if not isinstance(bitmask, jax.Array):
            bitmask = jax.device_put(bitmask)
        if self._thread is None:
            out, next_tokens = self._dispatch_sample(step, bitmask)
            self.last_enqueued = time.perf_counter()
        else:
            done = self._thread.call(timed, self._dispatch_sample, step, bitmask)
            out, next_tokens = Pending(done, 0), Pending(done, 1, self.no_prev.shape)
            self.last_enqueued = Pending(done, 2)
        if self.mirror is not None:   # only _mirror_step reads them: one process keeps none
            self._recent[step.step_index] = next_tokens
            self._recent.pop(step.step_index - 8, None)
        return out, next_tokens

    def _dispatch_forward(self, p: PackedInput):
        if isinstance(p.prev_tokens, Pending):
            p = dataclasses.replace(p, prev_tokens=p.prev_tokens.get())
        self.kv, forward = self._run_forward(self.kv, p)
        if self.fault_hook is not None:
            self.fault_hook("dispatched", self)
        return (forward,)

    def _dispatch_sample(self, step: SplitStep, bitmask):
        return self._run_sample(resolve(step.forward), step.packed, bitmask, step.step_index)

    def _run_forward(self, kv, p: PackedInput):
        """(new kv, (logits, SamplingArrays)): step_program.forward_step, dispatched. Its
        results stay in the persistent buffers (no copy): the sampling reads them before
        the next forward pass of this signature overwrites them."""
        key = ("forward", p.signature)
        fn = (self._executable(key, p)
              or functools.partial(self._forward_fn, spec=p.spec))
        slot, outs = self._step_buffers(p, key)
        try:
            kv, slot, results = fn(self._leaves, kv, slot, outs, p.buf, p.prev_tokens,
                                   self.lora)
        except Exception:
            self._buffers.pop(key, None)
            raise
        self._buffers[key] = (slot, None if outs is None else results)
        return kv, results

    def _run_sample(self, forward, p: PackedInput, bitmask, step_index: int):
        """(SampleOutput, next_tokens): step_program.sample_step on a forward pass's results."""
        num_seqs = np.shape(p.prev_tokens)[0]
        fn = (self._executable(sample_signature(p.spec, np.shape(bitmask), num_seqs), p)
              or functools.partial(self._sample_fn, num_seqs=num_seqs))
        return fn(*forward, bitmask, self._rng, np.uint32(step_index))
