"""JAX's persistent compilation cache, on by default: every executable the engine compiles is
kept on disk, so a restarted engine loads its steps instead of compiling them again.

JAX keys each entry by the program's HLO, its compile options and XLA flags, the jax/jaxlib
version and the device, so another model shape, engine config, jax build or GPU never reads
an entry that is not its own. An entry that fails to load (corrupt, or from an incompatible
build) is skipped with a warning and compiled afresh. The cache is trusted code: keep it in a
directory only you can write. Its key is the lowered program, so a restart still traces and
lowers every step; the engine's compiled steps are also kept beside it, keyed without tracing
(executable_store.py), and loaded from there first.
"""
from __future__ import annotations

from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

AUTO, OFF = "auto", "off"


def default_dir() -> Path:
    """The per-user cache directory "auto" uses when JAX names none."""
    return Path.home() / ".cache" / "jaxinfer" / "xla"


def enable(setting: str = AUTO) -> str | None:
    """Point JAX's persistent cache as `setting` says: "auto" keeps the directory JAX is
    already configured with (JAX_COMPILATION_CACHE_DIR or jax.config) or else uses
    default_dir(); "off" turns the cache off; anything else is the directory. Returns the
    directory in use, or None when off. Idempotent; call it before the engine compiles."""
    if setting == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    current = jax.config.jax_compilation_cache_dir
    path = setting if setting != AUTO else (current or str(default_dir()))
    jax.config.update("jax_enable_compilation_cache", True)
    # Every step executable, however quick to compile: a start-up compiles dozens.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if path != current:
        Path(path).mkdir(parents=True, exist_ok=True)
        compilation_cache.set_cache_dir(path)
        compilation_cache.reset_cache()      # a cache JAX opened before reads the new path
    return path
