"""The CPU suite's shared persistent compilation cache (tests/conftest.py) must not hide
compiles: an executable loaded from it still counts for runner.CompileCounter, so the
engine's "steady state compiles nothing" tests keep their meaning under the cache."""
import jax
import jax.numpy as jnp

from jaxinfer.runner import CompileCounter


def test_an_executable_loaded_from_the_cache_counts_as_a_compile():
    CompileCounter.install()
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **_kw: hits.append(1) if name == "/jax/compilation_cache/cache_hits"
        else None)

    def f(x):
        return jnp.sin(x) * 3 + jnp.arange(7.0)

    x = jnp.ones(7)
    before = CompileCounter.count()
    jax.jit(f)(x).block_until_ready()          # compiled (and written to the cache)
    compiled = CompileCounter.count()
    jax.clear_caches()                         # forget it in memory: the next call reloads
    jax.jit(f)(x).block_until_ready()
    assert hits, "no persistent-cache hit: the suite's cache is not on (tests/conftest.py)"
    assert compiled > before and CompileCounter.count() > compiled
