"""Ahead-of-time compilation of the runner's programs (a mixin of runner.ModelRunner): each
step's programs traced and lowered one at a time (Python), compiled concurrently in a thread
pool, kept for `dispatch` and in the executable store; and CompileCounter, which counts every
executable XLA hands out so tests and metrics can prove steady-state serving compiles
nothing."""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import jax
import numpy as np

from jaxinfer import executable_store, multihost
from jaxinfer.step_input import PackedInput, StepInput
from jaxinfer.step_program import forward_shapes, sample_signature, splits


class CompileCounter:
    """Counts the executables XLA hands out process-wide (jax.monitoring), so tests and
    metrics can prove that steady-state serving compiles nothing: count() all of them,
    loaded() those read from the persistent compilation cache instead of compiled."""

    _lock = threading.Lock()
    _count = 0
    _loaded = 0
    _installed = False

    @classmethod
    def install(cls):
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_duration(name, _secs, **_kw):
            if name == "/jax/core/compile/backend_compile_duration":
                with cls._lock:
                    cls._count += 1

        def on_event(name, **_kw):
            if name == "/jax/compilation_cache/cache_hits":
                with cls._lock:
                    cls._loaded += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    @classmethod
    def count(cls) -> int:
        return cls._count

    @classmethod
    def loaded(cls) -> int:
        return cls._loaded


class AheadOfTime:
    """ModelRunner's tracing, lowering and ahead-of-time compilation (it reads the runner's
    jitted programs, state, executables and store)."""

    def trace(self, inp: StepInput | PackedInput, part: str = "step"):
        """A program traced for `inp`'s shapes (`.lower()`, `.lower().compile()`: ahead-of-time
        compilation and the bench). part: "step", the whole step as one program (what runs
        unless the step is split); "forward" / "sample", a split step's two halves."""
        p = self.prepare(inp)
        if part == "step":
            return self._step_fn.trace(self._leaves, self.kv, *self._step_buffers(p), p.buf,
                                       p.prev_tokens, p.bitmask, self.lora, self._rng,
                                       np.uint32(0), spec=p.spec)
        if part == "forward":
            return self._forward_fn.trace(
                self._leaves, self.kv, *self._step_buffers(p, ("forward", p.signature)),
                p.buf, p.prev_tokens, self.lora, spec=p.spec)
        if part == "sample":
            forward = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._replicated),
                forward_shapes(p.spec, self.cfg.vocab_size))
            return self._sample_fn.trace(*forward, p.bitmask, self._rng, np.uint32(0),
                                         num_seqs=np.shape(p.prev_tokens)[0])
        raise ValueError(f"part must be 'step', 'forward' or 'sample', got {part!r}")

    def lower(self, inp: StepInput | PackedInput, part: str = "step"):
        """A program lowered for `inp`'s shapes (`trace`; ahead-of-time compilation, the
        bench)."""
        return self.trace(inp, part).lower()

    def programs(self, inp: StepInput | PackedInput) -> list:
        """(key, part) of each program a step of `inp`'s shapes runs: the executables'
        keys (compile_ahead) and `lower`'s part."""
        p = self.prepare(inp)
        if not splits(p.spec):
            return [(p.signature, "step")]
        return [(("forward", p.signature), "forward"),
                (sample_signature(p.spec, np.shape(p.bitmask), np.shape(p.prev_tokens)[0]),
                 "sample")]

    def compile_ahead(self, inputs, workers: int | None = None, on_done=None) -> int:
        """Compile the programs of a step for each of `inputs` (StepInputs or PackedInputs;
        `programs`) and keep the executables for `dispatch`: loaded from the executable store
        when it holds them (no tracing), else lowered one by one, compiled concurrently and
        stored. Returns how many were compiled; `on_done()` is called after each executable
        (a progress bar)."""
        lowered, t0 = {}, time.perf_counter()
        for inp in inputs:
            p = self.prepare(inp)
            for sig, part in self.programs(p):
                if sig in self._executables or sig in lowered:
                    continue
                stored = self.store.load(sig) if self.store is not None else None
                if stored is not None:
                    self._executables[sig] = stored
                    if on_done is not None:
                        on_done()
                    continue
                lowered[sig] = self.lower(p, part)
        workers = max(1, min(len(lowered), workers or os.cpu_count() or 1))
        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(executable_store.compile_lowered, low): sig
                       for sig, low in lowered.items()}
            for done in concurrent.futures.as_completed(futures):
                compiled, compiled_here = done.result()
                self._executables[futures[done]] = compiled
                if self.store is not None:
                    self.store.save(futures[done], compiled, compiled_here)
                if on_done is not None:
                    on_done()
        # Seconds spent loading stored executables and tracing and lowering the others (one
        # at a time, in Python), then compiling those (concurrently): the compile suite's split.
        self.compile_seconds["lower"] += t1 - t0
        self.compile_seconds["compile"] += time.perf_counter() - t1
        self._compiles += 1       # several processes: none runs a new program before all
        multihost.barrier(f"jaxinfer/compiled/{self._compiles}")   # have it (multihost.py)
        return len(lowered)
