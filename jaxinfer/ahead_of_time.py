"""Ahead-of-time compilation of the runner's programs (a mixin of runner.ModelRunner): each
step's programs traced and lowered one at a time (Python), compiled concurrently in a thread
pool as they are lowered (CompileQueue), kept for `dispatch` and in the executable store;
and CompileCounter, which counts every executable XLA hands out so tests and metrics can
prove steady-state serving compiles nothing."""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import jax
import numpy as np

from jaxinfer import executable_store, multihost, ops
from jaxinfer.step_input import PackedInput, StepInput, step_shape
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


class CompileQueue:
    """Lowered programs compiled in a thread pool as they come, each group's first before
    the rest of its group: programs whose GEMMs have the same rows (AheadOfTime.gemm_rows)
    share them, and their autotuning is most of a GPU compile. XLA keeps tuned GEMMs in a
    cache for the process, but programs compiled at the same time each tune them again (2x
    the cold compile of the offline config on an H100). keep(sig, compiled, compiled_here)
    takes each result, on the thread that calls `add` or `collect`."""

    def __init__(self, workers: int | None, keep):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, workers or os.cpu_count() or 1), thread_name_prefix="jaxinfer-compile")
        self._keep = keep
        self._futures: dict = {}    # future -> (signature, group or None)
        self._first: dict = {}      # group -> its first program's future
        self._waiting: dict = {}    # group -> [(signature, lowered, options)] after its first

    def add(self, sig, lowered, group=None, options=None) -> None:
        """Compile `lowered` (with XLA `options`) now, or after its group's first program
        (group None: now)."""
        first = self._first.get(group)
        if first is not None and not first.done():
            self._waiting.setdefault(group, []).append((sig, lowered, options))
        else:
            future = self._submit(sig, lowered, options, None if first is not None else group)
            if group is not None and first is None:
                self._first[group] = future
        self.collect(block=False)

    def _submit(self, sig, lowered, options, group):
        future = self._pool.submit(executable_store.compile_lowered, lowered, options)
        self._futures[future] = (sig, group)
        return future

    def collect(self, block: bool) -> None:
        """Hand the finished compiles to keep (block: until every one has finished)."""
        while self._futures:
            done = [f for f in self._futures if f.done()]
            if not done and not block:
                return
            if not done:
                done, _ = concurrent.futures.wait(
                    self._futures, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                sig, group = self._futures.pop(future)
                self._keep(sig, *future.result())
                for s, lowered, options in (self._waiting.pop(group, [])
                                            if group is not None else ()):
                    self._submit(s, lowered, options, None)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)


class AheadOfTime:
    """ModelRunner's tracing, lowering and ahead-of-time compilation (it reads the runner's
    jitted programs, state, executables and store)."""

    def trace(self, inp: StepInput | PackedInput, part: str = "step"):
        """A program traced for `inp`'s shapes (`.lower()`, `.lower().compile()`: ahead-of-time
        compilation and the bench). part: "step", the whole step as one program (what runs
        unless the step is split); "forward" / "sample", a split step's two halves."""
        p = self.prepare(inp)
        # The pool as it is (only its shapes and shardings count): its static FP8 scales may
        # still be calibrating (ModelRunner.kv).
        if part == "step":
            return self._step_fn.trace(self._leaves, self._kv, *self._step_buffers(p), p.buf,
                                       p.prev_tokens, p.bitmask, self.lora, self._rng,
                                       np.uint32(0), spec=p.spec)
        if part == "forward":
            return self._forward_fn.trace(
                self._leaves, self._kv, *self._step_buffers(p, ("forward", p.signature)),
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

    def gemm_rows(self, p: PackedInput) -> int:
        """The rows of `p`'s step's projections (its GEMMs' M): T, or a short decode step's
        padded rows (ops.decode_rows)."""
        t, decode_only = step_shape(p.spec)
        return ops.decode_rows(t, self.routes) if decode_only else t

    def compiler_options(self, p: PackedInput, part: str = "step") -> dict:
        """XLA options for compiling `p`'s program `part` (Routes.compiler_options by its
        GEMMs' rows; a split step's sampling half has no GEMMs and is shared by steps of
        other rows, so it takes none)."""
        if part == "sample" or not self.routes.triton_gemm_max_rows:
            return {}     # no rule (the CPU): no shape read
        return self.routes.compiler_options(self.gemm_rows(p))

    def compile_ahead(self, inputs, workers: int | None = None, on_done=None) -> int:
        """Compile the programs of a step for each of `inputs` (StepInputs or PackedInputs;
        `programs`) and keep the executables for `dispatch`: loaded from the executable store
        when it holds them (no tracing), else lowered one by one, the largest steps first,
        and compiled as they are lowered (CompileQueue: the programs of one `gemm_rows`
        after the first of them), and stored. Returns how many were compiled; `on_done()` is
        called after each executable (a progress bar)."""
        t0, lowered = time.perf_counter(), set()

        def keep(sig, compiled, compiled_here=False, store=True):
            self._executables[sig] = compiled
            if store and self.store is not None:
                self.store.save(sig, compiled, compiled_here)
            if on_done is not None:
                on_done()

        queue = CompileQueue(workers, keep)
        try:
            # The largest steps first: their compiles are the longest (the offline config's
            # 2,048-token step: 64 s of a 102 s cold warm-up on an H200).
            for p in sorted(map(self.prepare, inputs), key=self.gemm_rows, reverse=True):
                for sig, part in self.programs(p):
                    if sig in self._executables or sig in lowered:
                        continue
                    stored = self.store.load(sig) if self.store is not None else None
                    if stored is not None:
                        keep(sig, stored, store=False)
                        continue
                    lowered.add(sig)
                    queue.add(sig, self.lower(p, part),
                              None if part == "sample" else self.gemm_rows(p),
                              self.compiler_options(p, part))
            t1 = time.perf_counter()
            queue.collect(block=True)
        except BaseException:       # raise now: compiles already running finish unread
            queue.close(wait=False)
            raise
        queue.close()
        # Seconds until every program was loaded from the store or lowered (one at a time, in
        # Python; the first compiles run meanwhile), then until the last compile finished:
        # the compile suite's split.
        self.compile_seconds["lower"] += t1 - t0
        self.compile_seconds["compile"] += time.perf_counter() - t1
        self._compiles += 1       # several processes: none runs a new program before all
        multihost.barrier(f"jaxinfer/compiled/{self._compiles}")   # have it (multihost.py)
        return len(lowered)
