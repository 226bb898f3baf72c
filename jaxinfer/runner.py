"""The device side of a step: ONE jitted call per bucket — forward + logits of each row's last
token + sampling — with the KV cache donated (updated in place, never copied); a `full` step
without prompt targets runs as two, the forward pass and then the sampling
(step_program.splits), and `submit_forward` / `submit_sample` let the engine hand over the
token bitmask between them.

Static (a change compiles a new executable): the model graph, the `Routes`, and the
shapes of StepInput (= the bucket: T tokens, B rows, pages_per_seq) plus
`AttentionMetadata.decode_only` and the sampling arrays' static flags. Dynamic: every value.

Ahead-of-time executables (`compile_ahead`, used by Engine.warmup; ahead_of_time.py): every
bucket's programs (`programs`: the step, or a split step's two halves) are lowered (Python
tracing: one at a time) and then compiled in a thread pool; `dispatch` then calls the
executables matching the input's signature (PackedInput: tree structure + shapes + dtypes)
and falls back to the jitted function (which compiles, and is counted) for anything else.
Step inputs reach the device as one packed int32 buffer (step_input.py), copied into a
persistent slot; on the GPU the step's results are written into persistent donated buffers
and copied out for the caller (step_program.packed_step says why).

Tensor parallel (EngineConfig.tensor_parallel > 1): params arrive sharded (loading.py), the
cache is allocated sharded by kv head and pinned to that layout across the step (so the
donated buffers are reused in place); step inputs are replicated by jit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import drafting, lora_layers, sampling
from jaxinfer.ahead_of_time import AheadOfTime, CompileCounter  # noqa: F401 (re-exported)
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.dispatch_thread import DispatchThread, Pending, resolve, timed
from jaxinfer.errors import ConfigError
from jaxinfer.executable_store import ExecutableStore
from jaxinfer.kv_cache import (AttentionMetadata, KVCache, KVLayers, allocate_kv,
                               kv_pool_gib)
from jaxinfer.kv_calibration import CalibratedPool
from jaxinfer.routes import Routes
from jaxinfer.sharding import fetch, kv_spec, make_layout
from jaxinfer.split_step import SplitSteps
from jaxinfer.step_input import PackedInput, StepInput, pack_host, warmup_inputs
from jaxinfer.step_program import (all_logits_program, copy_out, copy_pages_program,
                                   forward_shapes, forward_step, output_shapes, packed_step,
                                   sample_step, splits)


@contextlib.contextmanager
def pool_oom_as_config_error(cfg: ModelConfig, engine: EngineConfig, where: str):
    """Inside: a device out-of-memory error (XLA's RESOURCE_EXHAUSTED) is re-raised as a
    ConfigError naming the pool's size and the settings that shrink it; other errors pass."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ConfigError(
            f"{where} ran out of device memory next to a KV pool of {engine.total_pages} pages "
            f"({kv_pool_gib(cfg, engine):.1f} GiB): lower num_pages (or max_num_seqs x "
            f"max_model_len, which size the pool when num_pages is 0) or "
            f"max_num_batched_tokens. XLA said: {str(e).splitlines()[0][:200]}") from e


class ModelRunner(AheadOfTime, SplitSteps, CalibratedPool):
    """Owns params, the KV cache and the compiled step. Host code hands it numpy arrays."""

    def __init__(self, cfg: ModelConfig, engine: EngineConfig, graphdef, params,
                 routes: Routes | None = None):
        """routes: the kernels' routes; None chooses them from `engine` and the backend."""
        CompileCounter.install()
        engine = engine.for_backend(jax.default_backend())
        self.cfg, self.engine = cfg, engine
        self.params = params
        self._leaves, self._treedef = jax.tree_util.tree_flatten(params)
        self._executables: dict = {}  # input signature -> compiled step (compile_ahead)
        self._jitted: set = set()     # signatures that run jitted: _executable asked once
        self.routes = routes or Routes.choose(engine, jax.default_backend())
        self.layout = make_layout(cfg, engine.tensor_parallel)
        model = nnx.merge(graphdef, params)
        self.engine = engine.replace(unroll_layers=model.unroll_layers)  # auto resolved
        if model.layout != self.layout:
            raise ConfigError(f"the params were built for another tensor-parallel layout than "
                              f"tensor_parallel={engine.tensor_parallel}: build them with "
                              f"checkpoints.model_state.build_model(..., "
                              f"layout=sharding.make_layout(cfg, tp))")
        kv_sharding = None if self.layout.mesh is None else self.layout.named(kv_spec(self.layout))
        self._logits_fn = jax.jit(functools.partial(all_logits_program, graphdef, self.routes,
                                                    kv_sharding=kv_sharding),
                                  donate_argnums=(1,))
        scales = self._start_calibration(
            cfg, lambda kv, tokens, md: self._logits_fn(self.params, kv, tokens, md)[0])
        with pool_oom_as_config_error(cfg, engine, "allocating the KV cache"):
            self._kv = allocate_kv(cfg, self.engine, self.layout, scales)
        self._rng = jax.random.key(engine.seed)
        self._num_steps = 0
        # Several processes (multihost.py): on the leader, what sends each call the followers
        # repeat (None on one process and on the followers); `_recent` maps the last steps'
        # next_tokens back to their step numbers, `no_prev` stands in for them when no step
        # is in flight (zeros: a step whose rows take no pending token).
        self.mirror = None
        self._quiet = False
        self._compiles = 0     # compile_ahead calls: the barriers' names
        self.compile_seconds = {"lower": 0.0, "compile": 0.0}   # compile_ahead's, summed
        self._recent: dict[int, object] = {}
        self.no_prev = jax.device_put(np.zeros(engine.max_num_seqs, np.int32))
        # Steps dispatched from a thread of their own (dispatch_thread.py): on the GPU, where
        # a sampling conditional blocks the dispatching thread and every launch takes ~1-2 ms
        # of host time, on one process, without speculation (its draft model reads the cache
        # between steps). last_enqueued: when the last step's dispatch returned (Pending while
        # the thread runs it; device_clock.py).
        self._thread = None
        self.last_enqueued = None
        if (jax.default_backend() == "gpu" and jax.process_count() == 1
                and not engine.num_speculative_tokens):
            self.start_dispatch_thread()
        self._step_fn = jax.jit(functools.partial(packed_step, graphdef, self.routes,
                                                  self._treedef, kv_sharding=kv_sharding),
                                donate_argnums=(1, 2, 3), static_argnames=("spec",))
        self._forward_fn = jax.jit(functools.partial(forward_step, graphdef, self.routes,
                                                     self._treedef, kv_sharding=kv_sharding),
                                   donate_argnums=(1, 2, 3), static_argnames=("spec",))
        self._sample_fn = jax.jit(sample_step, static_argnames=("num_seqs",))
        self._copy_fn = jax.jit(copy_pages_program, donate_argnums=(0,))
        # Self-speculation's draft program (speculative_method "self"), else None.
        self._draft_fn = None
        if self.engine.num_speculative_tokens and self.engine.speculative_method == "self":
            self._draft_fn = jax.jit(functools.partial(
                drafting.draft_tokens, graphdef, self.routes, self._treedef,
                k=self.engine.num_speculative_tokens,
                num_layers=self.engine.draft_layers(cfg.num_layers),
                page_size=self.engine.page_size, kv_sharding=kv_sharding),
                donate_argnums=(1,))
        # The LoRA adapters' device slots (lora_layers.py); None when max_loras is 0.
        self._replicated = (None if self.layout.mesh is None
                            else self.layout.named(jax.sharding.PartitionSpec()))
        self.lora = (lora_layers.allocate(cfg, self.engine, jnp.dtype(self.engine.dtype),
                                          self.engine.unroll_layers, self._replicated)
                     if self.engine.max_loras else None)
        # Compiled steps on disk, loaded without tracing on a restart (executable_store.py).
        self.store = ExecutableStore.for_jax_cache(
            repr(cfg), repr(self.engine), repr(self.routes), params, self._kv,
            devices=None if self.layout.mesh is None else self.layout.mesh.devices.flat)
        self._buffers: dict = {}  # input signature -> (slot, output buffers or None)
        # Fault injection for tests: called as fault_hook(phase, runner) at "dispatch" (before
        # the step's call), "dispatched" (after it: the cache was donated) and "fetch" (before
        # the engine reads a step's tokens); whatever it raises, the step raises.
        self.fault_hook = None

    def step(self, inp: StepInput | PackedInput) -> sampling.SampleOutput:
        """Run one step; returns the sampled tokens etc. as numpy (the one device->host sync)."""
        return fetch(resolve(self.submit(inp)[0]))

    def submit(self, inp: StepInput | PackedInput):
        """Dispatch one step without waiting: (SampleOutput, next_tokens [S]), both on the
        device (dispatch_thread.Pending while the dispatch thread runs it: `resolve` them);
        the cache is updated in place. Fetch the output with sharding.fetch. Sets
        last_enqueued."""
        if self.mirror is not None and not self._quiet:
            self._mirror_step(inp)
        self._num_steps += 1
        if self.fault_hook is not None:
            self.fault_hook("dispatch", self)
        if self._thread is None:
            self.sync()
            out, next_tokens = self._dispatch_step(inp, self._num_steps)
            self.last_enqueued = time.perf_counter()
        else:   # packed and moved to the device there too (`prepare`)
            done = self._thread.call(timed, self._dispatch_step, inp, self._num_steps)
            out, next_tokens = Pending(done, 0), Pending(done, 1, self.no_prev.shape)
            self.last_enqueued = Pending(done, 2)
        if self.mirror is not None:   # only _mirror_step reads them: one process keeps none
            self._recent[self._num_steps] = next_tokens
            self._recent.pop(self._num_steps - 8, None)
        return out, next_tokens

    def _dispatch_step(self, inp: StepInput | PackedInput, step_index: int):
        inp = self.prepare(inp)
        if isinstance(inp.prev_tokens, Pending):      # the step before's: dispatched by now
            inp = dataclasses.replace(inp, prev_tokens=inp.prev_tokens.get())
        self.kv, out, next_tokens = self.dispatch(self.kv, inp, step_index)
        if self.fault_hook is not None:
            self.fault_hook("dispatched", self)
        return out, next_tokens

    def start_dispatch_thread(self) -> None:
        """Dispatch the steps from a thread of their own from now on (dispatch_thread.py; on
        by default on the GPU)."""
        self._thread = self._thread or DispatchThread()

    @property
    def dispatches_on_thread(self) -> bool:
        """Steps are packed, moved and dispatched on the dispatch thread (`submit` takes
        their host input as it is)."""
        return self._thread is not None

    @property
    def dispatch_thread_seconds(self) -> float:
        """Seconds the dispatch thread has worked so far (packing, moving and dispatching
        steps; waits on a blocking dispatch included): 0 without one."""
        return 0.0 if self._thread is None else self._thread.busy_seconds

    def sync(self, raise_errors: bool = True) -> None:
        """Until the steps handed to the dispatch thread are dispatched (their outputs exist
        and the cache is the runner's again); raise_errors: raise what a dispatch raised."""
        if self._thread is not None:
            self._thread.wait(raise_errors)

    @property
    def num_steps(self) -> int:
        """Steps submitted so far (each one's rng is folded with its number)."""
        return self._num_steps

    def _mirror_step(self, inp) -> None:
        """Send the followers this step's host input (multihost.py)."""
        src = inp.source if isinstance(inp, PackedInput) else inp
        if src is None:
            raise RuntimeError("a step dispatched on several processes needs its host input "
                               "(ModelRunner.prepare keeps it)")
        prev = src.prev_tokens
        step = next((k for k, v in self._recent.items() if v is prev), None)
        if step is None and prev is not self.no_prev:
            raise RuntimeError("a step's pending tokens must come from a recent step's output "
                               "or the runner's no_prev on several processes")
        self.mirror.step(src, step)

    def copy_pages(self, pairs) -> None:
        """Copy KV pages on the device, each (source, destination) in `pairs`, after the
        steps dispatched before and before those after (copy-on-write of shared pages).
        One program of max_num_seqs pairs, padded with (0, 0): page 0 is reserved."""
        if self.mirror is not None and not self._quiet:
            self.mirror.call("copy", pairs=np.array(pairs, np.int32).reshape(-1, 2))
        self.sync()
        width = self.engine.max_num_seqs
        for i in range(0, len(pairs), width):
            idx = np.zeros((2, width), np.int32)
            idx[:, :len(pairs[i:i + width])] = np.array(pairs[i:i + width], np.int32).T
            self.kv = self._copy_fn(self.kv, idx[0], idx[1])

    def set_lora_slot(self, slot: int, adapter) -> None:
        """Write `adapter` (lora.LoRAAdapter; None: zeros) into LoRA slot `slot`, after the
        steps dispatched before and before those after. Never compiles after warm-up."""
        self.sync()
        host = lora_layers.host_slot(adapter, self.cfg, self.engine.max_lora_rank,
                                     jnp.dtype(self.engine.dtype),
                                     {"attn": self.layout.attn, "mlp": self.layout.mlp})
        if self._replicated is not None:
            host = jax.device_put(host, self._replicated)
        self.lora = lora_layers.write_slot(self.lora, np.int32(slot), host)

    def draft(self, tokens, positions, page_table, seq_lens, lengths, lora_index=None
              ) -> np.ndarray:
        """The on-device proposals [B, k] (numpy; waits for them): drafting.draft_tokens. The
        cache is updated in place, after the steps dispatched before."""
        self.sync()
        self.kv, out = self._draft_fn(self._leaves, self.kv, tokens, positions, page_table,
                                      seq_lens, lengths, self.lora, lora_index)
        return np.asarray(fetch(out))

    def warmup_drafts(self, sizes) -> None:
        """Compile (and run once, writing nothing) the draft program for each row count in
        `sizes`; nothing when the engine drafts on the host."""
        if self._draft_fn is None:
            return
        for b in sizes:
            zeros = np.zeros(b, np.int32)
            self.draft(zeros, zeros, np.zeros((b, self.engine.pages_per_seq), np.int32), zeros,
                       zeros, None if self.lora is None else np.full(b, -1, np.int32))

    def kv_lost(self) -> bool:
        """The KV cache's buffers are gone (donated to a step that then failed)."""
        self.sync(raise_errors=False)
        return any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.kv))

    def rebuild_kv(self) -> None:
        """A fresh, empty KV cache (and fresh step buffers) after `kv_lost`."""
        if self.mirror is not None:
            self.mirror.call("rebuild")
        self.sync(raise_errors=False)
        self._buffers.clear()
        for x in jax.tree_util.tree_leaves(self.kv):
            if not x.is_deleted():
                x.delete()
        with pool_oom_as_config_error(self.cfg, self.engine, "rebuilding the KV cache"):
            self._kv = allocate_kv(self.cfg, self.engine, self.layout, self.static_kv_scales)

    @staticmethod
    def prepare(inp: StepInput | PackedInput) -> PackedInput:
        """The input packed and on the device (one transfer; prev_tokens moved if on the
        host). Steps that reuse one input (the bench) prepare it once."""
        if isinstance(inp, PackedInput):
            return inp
        buf, spec = pack_host(inp)
        prev, mask = inp.prev_tokens, inp.token_bitmask
        return PackedInput(jax.device_put(buf),
                           prev if isinstance(prev, (jax.Array, Pending))
                           else jax.device_put(prev), spec,
                           mask if mask is None or isinstance(mask, jax.Array)
                           else jax.device_put(mask), source=inp)

    def dispatch(self, kv: KVCache | KVLayers, inp: StepInput | PackedInput, step_index: int):
        """(new kv, SampleOutput, next_tokens) on the device: the compiled step, dispatched
        without waiting; with routes.persistent_outputs, its results copied out of the step's
        persistent buffers, so the caller may keep them across later steps either way. `kv`
        is donated. For the bench's back to back runs."""
        p = self.prepare(inp)
        if splits(p.spec):
            kv, forward = self._run_forward(kv, p)
            return (kv, *self._run_sample(forward, p, p.bitmask, step_index))
        fn = (self._executable(p.signature, p)
              or functools.partial(self._step_fn, spec=p.spec))  # not compiled ahead: jit
        slot, outs = self._step_buffers(p)
        try:
            kv, slot, results = fn(self._leaves, kv, slot, outs, p.buf, p.prev_tokens,
                                   p.bitmask, self.lora, self._rng, np.uint32(step_index))
        except Exception:
            self._buffers.pop(p.signature, None)   # they may have been donated: make new ones
            raise
        if outs is None:
            self._buffers[p.signature] = (slot, None)
            out, next_tokens = results
        else:
            self._buffers[p.signature] = (slot, results)
            out, next_tokens = copy_out(results)
        return kv, out, next_tokens

    def _executable(self, key, p: PackedInput):
        """The program compiled ahead for `key` (None: jit it). compile_ahead compiles it
        first on several processes (every process compiles it, then runs it) and where its
        step takes XLA options (Routes.compiler_options), as warm-up would have. The answer
        for a jitted one is kept: its shape is not read again at every dispatch."""
        fn = self._executables.get(key)
        if fn is None and key not in self._jitted:
            if jax.process_count() > 1 or self.compiler_options(p):
                self.compile_ahead([p])
                fn = self._executables[key]
            else:
                self._jitted.add(key)
        return fn

    def _step_buffers(self, p: PackedInput, key=None):
        """The persistent buffers of `p`'s signature (see step_program.packed_step), made on
        first use: (the input slot, one int32 longer than the packed input; the output
        buffers, or None without routes.persistent_outputs), replicated on a mesh.
        key: ("forward", signature) for a split step's forward pass (its own buffers)."""
        key = p.signature if key is None else key
        bufs = self._buffers.get(key)
        if bufs is None:
            outs = None
            if self.routes.persistent_outputs:
                shapes = (forward_shapes(p.spec, self.cfg.vocab_size) if key != p.signature
                          else output_shapes(p.spec, self.cfg.vocab_size,
                                             np.shape(p.prev_tokens)[0]))
                outs = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
            bufs = (np.zeros(p.buf.shape[0] + 1, np.int32), outs)
            bufs = (jax.device_put(bufs) if self.layout.mesh is None
                    else jax.device_put(bufs, self.layout.named(jax.sharding.PartitionSpec())))
            self._buffers[key] = bufs
        return bufs

    def warmup(self, buckets, on_done=None, variants=("plain", "full"), on_total=None) -> None:
        """Compile the step's variants (`plain` and `full` by default; step_input.VARIANTS)
        for every bucket ahead of time, then run each once (writing nothing), so no request compiles
        later. A workload known to be all greedy without logprobs needs only `plain`.
        on_total(n): called first with the number of programs (on_done is called n times)."""
        if self.mirror is not None:     # the followers warm up the same buckets
            self.mirror.call("warmup", {"variants": list(variants)})
        inputs = [self.prepare(i)   # packed once, for the compile and the run
                  for i in warmup_inputs(buckets, self.engine.max_num_seqs, variants,
                                         self.cfg.vocab_size, self.lora is not None)]
        if on_total is not None:
            on_total(len({key for p in inputs for key, _ in self.programs(p)}))
        # XLA's autotuner tries each GEMM's configurations in buffers of their own, beside the
        # pool: a pool sized to the last GiB leaves it none.
        with pool_oom_as_config_error(self.cfg, self.engine, "compiling the steps"):
            self.compile_ahead(inputs, on_done=on_done)
        quiet, self._quiet = self._quiet, True
        try:
            with pool_oom_as_config_error(self.cfg, self.engine, "a warm-up step"):
                for inp in inputs:
                    self.step(inp)
                self.copy_pages([(0, 0)])      # the page copy of n > 1 requests' forks
        finally:
            self._quiet = quiet

    def all_logits(self, tokens, md: AttentionMetadata) -> np.ndarray:
        """Teacher-forced logits [T, V] for every new token (tests, perplexity)."""
        self.sync()
        self.kv, logits = self._logits_fn(self.params, self.kv, jnp.asarray(tokens), md)
        return np.asarray(fetch(logits))
