"""Compiled steps kept on disk and loaded on a restart without tracing them again.

JAX's persistent compilation cache (compile_cache.py) saves the compiling but not the
tracing and lowering: its key is the lowered program, so a restarted engine still traces and
lowers each of its executables before the cache can answer. This store keys each compiled
step by what shapes it instead, and keeps the executable serialized
(jax.experimental.serialize_executable) under that key:
  - jaxinfer's own code: every .py file of jaxinfer, pallas_kernels and checkpoints;
  - jax, jaxlib and flax versions, the platform's devices, the devices the steps run on,
    XLA_FLAGS and JAX's configuration options;
  - the model and engine configs and the kernels' routes;
  - the params' and KV cache's tree structure, shapes, dtypes and shardings;
  - the step's input signature (bucket and sampling variant).
Anything else that changed is another key, never a stale program. An entry that fails to
load (corrupt, truncated, from another build) is ignored with a warning and compiled afresh.
Only executables XLA compiled in this process are stored: one that JAX's persistent cache
answered does not serialize again whole on XLA's CPU backend (it loads, then fails to run
with "Function ... not found"). Nor does a compile JAX answered from memory (the same
program compiled before in this process, by an engine of another key), which records no
cache event at all; so `compile_lowered` reports a step as compiled here only when JAX
recorded a cache miss for it on the compiling thread. A step not stored is loaded from JAX's
cache again on the next start (traced and lowered, as without the store).
The store sits in JAX's cache directory (`jaxinfer-steps/`) and is off when that cache is;
like it, it is trusted code: keep it in a directory only you can write.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import threading
from pathlib import Path

import flax
import jax
from jax.experimental import serialize_executable

log = logging.getLogger("jaxinfer.executable_store")
_PACKAGES = ("jaxinfer", "pallas_kernels", "checkpoints")
_CACHE_MISS = "/jax/compilation_cache/cache_misses"
_misses = threading.local()      # JAX's persistent-cache misses (XLA compiles) on this thread


def _count_miss(event: str, **_) -> None:
    if event == _CACHE_MISS:
        _misses.count = getattr(_misses, "count", 0) + 1


jax.monitoring.register_event_listener(_count_miss)


def compile_lowered(lowered, options: dict | None = None):
    """lowered.compile() (with XLA `options`, Routes.compiler_options), and whether XLA
    compiled it here: JAX recorded a persistent-cache miss for it on the compiling thread.
    False when JAX's persistent cache answered it, or its in-memory cache did (no event):
    neither may be stored."""
    before = getattr(_misses, "count", 0)
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    return compiled, getattr(_misses, "count", 0) > before


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over the path and bytes of every .py file of jaxinfer's packages."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _avals(tree) -> str:
    """Tree structure, then shape, dtype and sharding of every leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return repr(treedef) + repr([(getattr(x, "shape", None), str(getattr(x, "dtype", "")),
                                  str(getattr(x, "sharding", ""))) for x in leaves])


class ExecutableStore:
    def __init__(self, directory: str | Path, *context, devices=None):
        """`context`: what besides the code and the platform shapes the steps (the configs,
        routes, params and KV cache); hashed once here. `devices`: those the steps run on, in
        the order they were compiled for (a mesh's); None: the default device. A loaded step
        runs on them, not on every device of the platform."""
        self.directory = Path(directory)
        self.devices = list(devices) if devices is not None else jax.devices()[:1]
        jax_options = {k: v for k, v in jax.config.values.items() if "cache" not in k}
        h = hashlib.sha256()
        for part in (source_digest(), jax.__version__, jax.lib.__version__, flax.__version__,
                     repr([(d.platform, d.device_kind) for d in jax.devices()]),
                     repr([d.id for d in self.devices]),
                     os.environ.get("XLA_FLAGS", ""), repr(sorted(jax_options.items())),
                     *(c if isinstance(c, str) else _avals(c) for c in context)):
            h.update(part.encode())
            h.update(b"\0")
        self._context = h.hexdigest()
        self.loaded = 0     # executables loaded from the store so far

    @classmethod
    def for_jax_cache(cls, *context, devices=None) -> "ExecutableStore | None":
        """The store in JAX's persistent cache directory, or None when that cache is off."""
        cache_dir = jax.config.jax_compilation_cache_dir
        if not jax.config.jax_enable_compilation_cache or not cache_dir:
            return None
        return cls(Path(cache_dir) / "jaxinfer-steps", *context, devices=devices)

    def _path(self, signature) -> Path:
        key = hashlib.sha256((self._context + repr(signature)).encode()).hexdigest()
        return self.directory / f"{key}.pkl"

    def load(self, signature):
        """The compiled step of `signature`, or None (not stored, or unreadable: a warning)."""
        path = self._path(signature)
        if not path.exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=self.devices)
        except Exception as e:
            log.warning("ignoring the stored step %s (%s: %s); compiling it again", path.name,
                        type(e).__name__, e)
            return None
        self.loaded += 1
        return compiled

    def save(self, signature, compiled, compiled_here: bool) -> None:
        """Keep `compiled` (written atomically; a failure is a warning, never an error) if
        XLA compiled it in this process (`compile_lowered`); else it is not kept."""
        if not compiled_here:
            return
        path = self._path(signature)
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        except Exception as e:
            log.warning("could not store a compiled step (%s: %s)", type(e).__name__, e)
