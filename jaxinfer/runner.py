"""The device side of a step: ONE jitted call per bucket — forward + logits of each row's last
token + sampling — with the KV cache donated (updated in place, never copied).

Static (a change compiles a new executable): the model graph, the attention impl, and the
shapes of StepInput (= the bucket: T tokens, B rows, pages_per_seq) plus
`AttentionMetadata.decode_only` and the sampling arrays' static flags. Dynamic: every value.

Ahead-of-time executables (`compile_ahead`, used by Engine.warmup): every bucket's step is
lowered (Python tracing: one at a time) and then compiled in a thread pool (on the H200,
26 executables in 45 s where 13 took 61 s one after another; 6.4 s from the persistent
cache); `dispatch` then calls the executable matching the input's signature (PackedInput:
tree structure + shapes + dtypes) and falls back to the jitted function (which compiles, and
is counted) for anything else. Step inputs reach the device as one packed int32 buffer.

Tensor parallel (EngineConfig.tensor_parallel > 1): params arrive sharded (loading.py), the
cache is allocated sharded by kv head and pinned to that layout across the step (so the
donated buffers are reused in place); step inputs are replicated by jit.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import kv_calibration, sampling
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.kv_cache import FP8_DTYPE, AttentionMetadata, KVCache, KVLayers
from jaxinfer.ops import resolve_attention_impl
from jaxinfer.request import SamplingParams
from jaxinfer.sharding import TPLayout, kv_spec, make_layout


class CompileCounter:
    """Counts XLA backend compiles process-wide (jax.monitoring), so tests and metrics can
    prove that steady-state serving compiles nothing."""

    _lock = threading.Lock()
    _count = 0
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

        jax.monitoring.register_event_duration_secs_listener(on_duration)

    @classmethod
    def count(cls) -> int:
        return cls._count


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "md", "logits_index", "sampling", "prev_tokens",
                                "prev_index"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StepInput:
    tokens: jax.Array                  # [T] i32 (padding: 0)
    md: AttentionMetadata
    logits_index: jax.Array            # [B] i32  index in T of each row's last new token
    sampling: sampling.SamplingArrays  # per-row parameters [B, ...]
    # Async scheduling: tokens the host does not know yet come from the previous step's
    # sampled tokens (its third output, padded to max_num_seqs), still on the device.
    prev_tokens: jax.Array             # [S] i32  S = max_num_seqs (zeros when unused)
    prev_index: jax.Array              # [T] i32  row of prev_tokens for token t, -1 = tokens[t]


def _forward_hidden(graphdef, attn_impl, params, kv, tokens, md, kv_sharding=None):
    model = nnx.merge(graphdef, params)
    h, kv = model(tokens, kv, md, attn_impl)
    if kv_sharding is not None:
        kv = jax.lax.with_sharding_constraint(kv, kv_sharding)
    return model, h, kv


def _step(graphdef, attn_impl, treedef, leaves, kv, inp: StepInput, rng, step_index,
          kv_sharding=None):
    # The params travel as a flat list of arrays: flattening the nnx.State (hundreds of
    # leaves with per-layer weights) in Python on every dispatch cost more than the rest.
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    tokens = jnp.where(inp.prev_index >= 0,
                       inp.prev_tokens[jnp.maximum(inp.prev_index, 0)], inp.tokens)
    model, h, kv = _forward_hidden(graphdef, attn_impl, params, kv, tokens, inp.md,
                                   kv_sharding)
    logits = model.logits(h[inp.logits_index])                          # [B, V] f32
    out = sampling.sample(logits, inp.sampling, jax.random.fold_in(rng, step_index))
    # The sampled tokens padded to [S]: the next step's prev_tokens (one shape for all buckets).
    next_tokens = jnp.zeros_like(inp.prev_tokens).at[:out.tokens.shape[0]].set(out.tokens)
    return kv, out, next_tokens


@dataclasses.dataclass(frozen=True)
class PackedInput:
    """A StepInput as it travels to the device: every leaf but prev_tokens bit-cast to int32
    and concatenated into ONE buffer (one host->device transfer instead of ~20; on the CPU
    that was a third of the host's time per step at 256 rows), unpacked inside the jitted
    step by static offsets. prev_tokens stays apart: it is usually the previous step's
    output, already on the device."""
    buf: jax.Array          # [N] i32
    prev_tokens: jax.Array  # [S] i32
    spec: tuple             # static: (tree structure, ((shape, dtype name), ...) per leaf)

    @property
    def signature(self) -> tuple:
        """What selects a compiled step: the spec (tree structure with its static fields,
        every leaf's shape and dtype) and prev_tokens' length."""
        return self.spec, tuple(np.shape(self.prev_tokens))


def pack_host(inp: StepInput) -> tuple[np.ndarray, tuple]:
    """(int32 buffer, spec) of every leaf of `inp` but prev_tokens (numpy or jax leaves)."""
    leaves, tree = jax.tree_util.tree_flatten(dataclasses.replace(inp, prev_tokens=None))
    parts, fields = [], []
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype == np.bool_:
            parts.append(a.astype(np.int32).ravel())
        elif a.dtype.itemsize == 4:
            parts.append(np.ascontiguousarray(a).view(np.int32).ravel())
        else:
            raise TypeError(f"StepInput leaf of dtype {a.dtype} cannot be packed (4-byte "
                            f"dtypes and bool only)")
        fields.append((a.shape, a.dtype.name))
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buf, (tree, tuple(fields))


def unpack(buf, spec, prev_tokens) -> StepInput:
    """Inside the jitted step: the StepInput back from its buffer (static slices)."""
    tree, fields = spec
    leaves, off = [], 0
    for shape, name in fields:
        n = int(np.prod(shape, dtype=np.int64))
        x = buf[off:off + n].reshape(shape)
        off += n
        dt = np.dtype(name)
        if dt == np.bool_:
            x = x != 0
        elif dt != np.int32:
            x = jax.lax.bitcast_convert_type(x, dt)
        leaves.append(x)
    return dataclasses.replace(jax.tree_util.tree_unflatten(tree, leaves),
                               prev_tokens=prev_tokens)


def _packed_step(graphdef, attn_impl, treedef, leaves, kv, slot, buf, prev_tokens, rng,
                 step_index, spec, kv_sharding=None):
    """The step on a packed input. `buf` is copied into `slot` first, a donated buffer one
    element longer that comes back as an output, so it keeps its device address from call to
    call: every layer reads positions and page tables from there, and only the copy reads the
    fresh `buf`. XLA updates a command buffer's (CUDA graph's) kernels whose buffers moved
    since the last call; with the step's input read from a fresh buffer, that was a kernel
    node of every layer on every call. The barrier keeps XLA from reading `buf` directly
    through the copy; the extra element keeps the update from covering the whole slot."""
    slot = jax.lax.optimization_barrier(jax.lax.dynamic_update_slice(slot, buf, (0,)))
    kv, out, next_tokens = _step(graphdef, attn_impl, treedef, leaves, kv,
                                 unpack(slot, spec, prev_tokens), rng, step_index, kv_sharding)
    return kv, out, next_tokens, slot


def dummy_input(bucket, full: bool = False, max_num_seqs: int | None = None) -> StepInput:
    """An all-padding input of `bucket`'s shapes: writes nothing, used to compile ahead.
    full: the `full` sampling variant (penalty window; sampling.py's module doc) instead of
    the all-greedy `plain` one: the two compiled variants of each bucket. max_num_seqs: the
    engine's (the prev_tokens length; default the bucket's rows, for one-off compiles)."""
    t, b, w = bucket.num_tokens, bucket.num_seqs, bucket.pages_per_seq
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    md = AttentionMetadata(zeros(t), np.full(t, -1, np.int32), zeros(t), zeros(b, w), zeros(b),
                           zeros(b + 1), decode_only=bucket.decode_only)
    rows = [SamplingParams(repetition_penalty=1.1)] if full else []
    samp = sampling.SamplingArrays.from_params(rows, [0] * len(rows), [[0]] * len(rows),
                                               batch_size=b)
    return StepInput(zeros(t), md, zeros(b), samp, zeros(max_num_seqs or b),
                     np.full(t, -1, np.int32))


def warmup_inputs(buckets, max_num_seqs: int, variants=("plain", "full")) -> list[StepInput]:
    """The all-padding inputs that compile `variants` (sampling `plain` / `full`) of every
    bucket: what Engine.warmup compiles ahead of time."""
    if not variants or set(variants) - {"plain", "full"}:
        raise ValueError(f"warmup: variants must be from ('plain', 'full'), got {variants}")
    return [dummy_input(b, full, max_num_seqs) for b in buckets for full in (False, True)
            if ("full" if full else "plain") in variants]


def _all_logits(graphdef, attn_impl, params, kv, tokens, md, kv_sharding=None):
    model, h, kv = _forward_hidden(graphdef, attn_impl, params, kv, tokens, md, kv_sharding)
    return kv, model.logits(h)                                           # [T, V] f32


def kv_dtype_for(engine: EngineConfig):
    if engine.kv_dtype == "fp8":
        return FP8_DTYPE
    if engine.kv_dtype == "bf16":
        return jnp.bfloat16
    return jnp.dtype(engine.dtype)


def kv_page_bytes(cfg: ModelConfig, engine: EngineConfig) -> int:
    """One page's bytes over all layers: K and V, and with per-token FP8 scales those (f32;
    static ones are [L, K] for the whole pool)."""
    dtype = jnp.dtype(kv_dtype_for(engine))
    token_scales = dtype == FP8_DTYPE and engine.kv_scales == "token"
    per_slot = cfg.head_dim * dtype.itemsize + (4 if token_scales else 0)
    return 2 * cfg.num_layers * cfg.num_kv_heads * engine.page_size * per_slot


def kv_pool_gib(cfg: ModelConfig, engine: EngineConfig) -> float:
    """The whole KV pool's size in GiB (kv_page_bytes x the pool's pages)."""
    return kv_page_bytes(cfg, engine) * engine.total_pages / 2 ** 30


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


def allocate_kv(cfg: ModelConfig, engine: EngineConfig, layout: TPLayout, scales=None
                ) -> KVCache | KVLayers:
    """The engine's page pool: KVLayers for the unrolled decoder (engine.unroll_layers
    resolved), one KVCache of all layers for the scanned one (kv_cache.py says why); on a
    mesh each device allocates only its own kv heads. scales: static FP8 scales (k, v) [L, K]
    (kv_calibration.py), or None."""
    form = KVLayers if engine.unroll_layers else KVCache
    alloc = functools.partial(form.allocate, cfg.num_layers, cfg.num_kv_heads,
                              engine.total_pages, engine.page_size, cfg.head_dim,
                              kv_dtype_for(engine), scales=scales)
    if layout.mesh is None:
        return alloc()
    return jax.jit(alloc, out_shardings=layout.named(kv_spec(layout)))()


class ModelRunner:
    """Owns params, the KV cache and the compiled step. Host code hands it numpy arrays."""

    def __init__(self, cfg: ModelConfig, engine: EngineConfig, graphdef, params):
        CompileCounter.install()
        self.cfg, self.engine = cfg, engine
        self.params = params
        self._leaves, self._treedef = jax.tree_util.tree_flatten(params)
        self._executables: dict = {}  # input signature -> compiled step (compile_ahead)
        self.attn_impl = resolve_attention_impl(engine.attention_impl)
        self.layout = make_layout(cfg, engine.tensor_parallel)
        model = nnx.merge(graphdef, params)
        self.engine = engine.replace(unroll_layers=model.unroll_layers)  # auto resolved
        if model.layout != self.layout:
            raise ConfigError(f"the params were built for another tensor-parallel layout than "
                              f"tensor_parallel={engine.tensor_parallel}: build them with "
                              f"params.build_model(..., layout=sharding.make_layout(cfg, tp))")
        kv_sharding = None if self.layout.mesh is None else self.layout.named(kv_spec(self.layout))
        self._logits_fn = jax.jit(functools.partial(_all_logits, graphdef, self.attn_impl,
                                                    kv_sharding=kv_sharding),
                                  donate_argnums=(1,))
        # (k, v) [L, K] numpy f32 for FP8 KV with static scales (kv_calibration.py), else None
        self.static_kv_scales = kv_calibration.engine_scales(
            cfg, self.engine, self.layout,
            lambda kv, tokens, md: self._logits_fn(self.params, kv, tokens, md)[0])
        with pool_oom_as_config_error(cfg, engine, "allocating the KV cache"):
            self.kv = allocate_kv(cfg, self.engine, self.layout, self.static_kv_scales)
        self._rng = jax.random.key(engine.seed)
        self._num_steps = 0
        self._step_fn = jax.jit(functools.partial(_packed_step, graphdef, self.attn_impl,
                                                  self._treedef, kv_sharding=kv_sharding),
                                donate_argnums=(1, 2), static_argnames=("spec",))
        self._slots: dict = {}  # input signature -> its persistent input slot (_packed_step)

    def step(self, inp: StepInput | PackedInput) -> sampling.SampleOutput:
        """Run one step; returns the sampled tokens etc. as numpy (the one device->host sync)."""
        return jax.device_get(self.submit(inp)[0])

    def submit(self, inp: StepInput | PackedInput):
        """Dispatch one step without waiting: (SampleOutput, next_tokens [S]), both on the
        device; the cache is updated in place. Fetch the output with jax.device_get."""
        self._num_steps += 1
        self.kv, out, next_tokens = self.dispatch(self.kv, inp, self._num_steps)
        return out, next_tokens

    @staticmethod
    def prepare(inp: StepInput | PackedInput) -> PackedInput:
        """The input packed and on the device (one transfer; prev_tokens moved if on the
        host). Steps that reuse one input (the bench) prepare it once."""
        if isinstance(inp, PackedInput):
            return inp
        buf, spec = pack_host(inp)
        buf, prev = jax.device_put((buf, inp.prev_tokens))
        return PackedInput(buf, prev, spec)

    def dispatch(self, kv: KVCache | KVLayers, inp: StepInput | PackedInput, step_index: int):
        """(new kv, SampleOutput, next_tokens) on the device: the compiled step, dispatched
        without waiting. `kv` is donated. For the bench's back-to-back runs."""
        p = self.prepare(inp)
        fn = (self._executables.get(p.signature)
              or functools.partial(self._step_fn, spec=p.spec))   # not compiled ahead: jit
        slot = self._slot(p)
        try:
            kv, out, next_tokens, slot = fn(self._leaves, kv, slot, p.buf, p.prev_tokens,
                                            self._rng, np.uint32(step_index))
        except Exception:
            self._slots.pop(p.signature, None)   # it may have been donated: make a new one
            raise
        self._slots[p.signature] = slot
        return kv, out, next_tokens

    def _slot(self, p: PackedInput):
        """The persistent input slot of `p`'s signature (see _packed_step), made on first use:
        one int32 longer than the packed input, replicated on a mesh."""
        slot = self._slots.get(p.signature)
        if slot is None:
            zeros = np.zeros(p.buf.shape[0] + 1, np.int32)
            slot = (jax.device_put(zeros) if self.layout.mesh is None
                    else jax.device_put(zeros, self.layout.named(jax.sharding.PartitionSpec())))
            self._slots[p.signature] = slot
        return slot

    def trace(self, inp: StepInput | PackedInput):
        """The step traced for `inp`'s shapes (`.lower()`, `.lower().compile()`: ahead-of-time
        compilation and the bench)."""
        p = self.prepare(inp)
        return self._step_fn.trace(self._leaves, self.kv, self._slot(p), p.buf, p.prev_tokens,
                                   self._rng, np.uint32(0), spec=p.spec)

    def lower(self, inp: StepInput | PackedInput):
        """The step lowered for `inp`'s shapes (for ahead-of-time compilation and the bench)."""
        return self.trace(inp).lower()

    def compile_ahead(self, inputs, workers: int | None = None, on_done=None) -> int:
        """Compile the step for each of `inputs` (StepInputs or PackedInputs of distinct
        shapes) and keep the executables for `dispatch`: lowered one by one, compiled
        concurrently. Returns how many were compiled; `on_done()` is called after each (a
        progress bar)."""
        lowered = {}
        for inp in inputs:
            p = self.prepare(inp)
            if p.signature not in self._executables and p.signature not in lowered:
                lowered[p.signature] = self.lower(p)
        workers = max(1, min(len(lowered), workers or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(low.compile): sig for sig, low in lowered.items()}
            for done in concurrent.futures.as_completed(futures):
                self._executables[futures[done]] = done.result()
                if on_done is not None:
                    on_done()
        return len(lowered)

    def warmup(self, buckets, on_done=None, variants=("plain", "full")) -> None:
        """Compile the step's sampling variants (`plain` and `full` by default) for every
        bucket ahead of time, then run each once (writing nothing), so no request compiles
        later. A workload known to be all greedy without logprobs needs only `plain`."""
        inputs = [self.prepare(i)   # packed once, for the compile and the run
                  for i in warmup_inputs(buckets, self.engine.max_num_seqs, variants)]
        self.compile_ahead(inputs, on_done=on_done)
        with pool_oom_as_config_error(self.cfg, self.engine, "a warm-up step"):
            for inp in inputs:
                self.step(inp)

    def all_logits(self, tokens, md: AttentionMetadata) -> np.ndarray:
        """Teacher-forced logits [T, V] for every new token (tests, perplexity)."""
        self.kv, logits = self._logits_fn(self.params, self.kv, jnp.asarray(tokens), md)
        return np.asarray(logits)
