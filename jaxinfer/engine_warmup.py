"""Compiling every bucket before the first request (a mixin of Engine: it reads the
engine's runner, buckets, draft model and LoRA slots): `warmup`, and `compiles`, the count
that proves steady-state serving compiles nothing."""
from __future__ import annotations

import itertools
import time

from tqdm import tqdm

from jaxinfer.ahead_of_time import CompileCounter


class EngineWarmup:
    @staticmethod
    def compiles() -> int:
        """Executables XLA handed out in this process so far, compiled or loaded from the
        persistent compilation cache (steady-state serving adds none)."""
        return CompileCounter.count()

    def warmup(self, progress: bool = True, variants=("plain", "full"),
               on_done=None) -> dict:
        """Compile every bucket ahead of time (or load it from the executable store or the
        persistent compilation cache); returns {'compiles', 'loaded_from_cache',
        'loaded_from_store', 'seconds', 'buckets', 'lower_seconds', 'compile_seconds'}: of
        the seconds, those spent loading stored executables and tracing the others, then
        compiling them; the rest runs each program once.
        variants: the sampling variants to compile (ModelRunner.warmup); a server needs
        both, an all-greedy offline run only `plain`. progress: a progress bar on stderr;
        on_done(done, total): called after each executable (a server's log)."""
        t0, c0, l0 = time.perf_counter(), CompileCounter.count(), CompileCounter.loaded()
        split0 = dict(self.runner.compile_seconds)
        store = self.runner.store
        s0 = store.loaded if store is not None else 0
        buckets = self.buckets.all_buckets()
        total = [0]
        with tqdm(desc=f"compiling buckets (x{len(variants)} sampling variants)",
                  disable=not progress, unit="program") as bar:
            finished = itertools.count(1)

            def count(n):
                total[0] = bar.total = n
                bar.refresh()

            def done():      # the bar counts nothing when disabled
                bar.update(1)
                if on_done is not None:
                    on_done(next(finished), total[0])
            self.runner.warmup(buckets, on_done=done, variants=variants, on_total=count)
            self._warm_drafts()
            if self.loras is not None:
                self._warm_lora_slots()
        loaded = CompileCounter.loaded() - l0
        return {"compiles": CompileCounter.count() - c0 - loaded, "loaded_from_cache": loaded,
                "loaded_from_store": (store.loaded if store is not None else 0) - s0,
                "seconds": time.perf_counter() - t0, "buckets": len(buckets),
                **{f"{k}_seconds": v - split0[k] for k, v in self.runner.compile_seconds.items()}}
