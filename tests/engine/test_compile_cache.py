"""The persistent compilation cache: on by default for every engine (jaxinfer/compile_cache.py),
a restart on the same cache compiles nothing, a corrupt entry is skipped, and the suite's own
shared cache (tests/conftest.py) does not hide compiles from runner.CompileCounter."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.runner import CompileCounter

TESTS = Path(__file__).resolve().parents[1]


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


# A fresh process builds the tiny engine with `compile_cache`, compiles every bucket and runs
# one greedy and one sampled request; it prints what XLA compiled and what it loaded. Given
# engine seeds, it builds one engine per seed in turn and prints after the last.
_START = """
import json, sys
import jax.numpy as jnp
from dense_reference import random_flat
from engine_util import TINY
from checkpoints.model_state import build_model
from jaxinfer import SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.runner import CompileCounter, ModelRunner
lowered, lower = [], ModelRunner.lower
ModelRunner.lower = lambda self, inp, *a: lowered.append(1) or lower(self, inp, *a)
for seed in map(int, sys.argv[2:] or ["0"]):
    cfg = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                       page_size=4, compile_cache=sys.argv[1], seed=seed)
    engine = Engine(TINY, cfg, *build_model(TINY, random_flat(TINY, seed=3), jnp.float32))
    warm = engine.warmup(progress=False)
    for p in (SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=4)):
        engine.add_request({"prompt_token_ids": [5, 6, 7]}, p)
    tokens = [o.token_ids for o in engine.run_until_done(use_tqdm=False).values()]
print(json.dumps({"compiled": CompileCounter.count() - CompileCounter.loaded(),
                  "loaded": CompileCounter.loaded(), "warm": warm, "tokens": tokens,
                  "lowered": len(lowered)}))
"""


def _start(setting: str, cache_env: str | None = None, devices: int = 1, seeds=(0,)):
    """devices: CPU devices the process has (the engine runs on one of them)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    if cache_env:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_env
    if devices > 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + f" --xla_force_host_platform_device_count={devices}").strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _START, setting, *map(str, seeds)],
                          env=env, text=True,
                          capture_output=True, timeout=600, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_restart_on_the_same_cache_compiles_nothing(tmp_path, devices=2):
    """Engine start-up against an empty cache compiles; the same start in a new process on
    that cache loads every executable (0 compiled), its steps from the executable store
    without tracing them (0 lowered), and answers the same. The processes have two devices
    and the engine one: a stored step loads onto the engine's device, not onto both."""
    cache = tmp_path / "xla"
    first, _ = _start(str(cache), devices=devices)
    assert first["compiled"] > 0 and first["warm"]["compiles"] > 0 and first["lowered"] > 0
    assert first["warm"]["loaded_from_store"] == 0
    assert any(cache.iterdir()), "nothing written to the cache"
    assert len(list((cache / "jaxinfer-steps").iterdir())) == first["lowered"]
    again, _ = _start(str(cache), devices=devices)
    assert again["compiled"] == 0 and again["warm"]["compiles"] == 0
    assert again["lowered"] == 0 and again["warm"]["loaded_from_store"] == first["lowered"]
    assert again["loaded"] + again["warm"]["loaded_from_store"] >= first["warm"]["compiles"]
    assert again["tokens"] == first["tokens"]


def test_steps_answered_by_the_jax_cache_are_not_stored(tmp_path):
    """A start whose steps JAX's persistent cache answers (the store emptied, or keyed anew by
    an edit) stores none of them: such an executable does not serialize again whole on the
    CPU backend. The next start loads them from JAX's cache again and answers the same."""
    cache = tmp_path / "xla"
    first, _ = _start(str(cache))
    shutil.rmtree(cache / "jaxinfer-steps")
    second, _ = _start(str(cache))
    assert second["lowered"] == first["lowered"] and second["warm"]["compiles"] == 0
    assert second["loaded"] >= first["lowered"], "JAX's cache did not answer the steps"
    assert not list((cache / "jaxinfer-steps").glob("*.pkl"))
    third, _ = _start(str(cache))
    assert third["lowered"] == first["lowered"] and third["warm"]["compiles"] == 0
    assert third["tokens"] == second["tokens"] == first["tokens"]


def test_steps_jax_answered_from_memory_are_not_stored(tmp_path):
    """Two engines in one process whose programs are the same but whose store keys differ
    (another seed): JAX answers the second engine's compiles from memory, recording no
    cache event. When the first engine's steps came from JAX's persistent cache, those
    executables do not serialize whole either, so the second engine stores none of them,
    and a later start of its configuration runs instead of failing with "Function ... not
    found"."""
    cache = tmp_path / "xla"
    _start(str(cache))
    shutil.rmtree(cache / "jaxinfer-steps")
    both, _ = _start(str(cache), seeds=(0, 1))
    assert both["warm"]["compiles"] == 0
    assert not list((cache / "jaxinfer-steps").glob("*.pkl"))
    again, _ = _start(str(cache), seeds=(1,))
    assert again["warm"]["compiles"] == 0 and again["tokens"] == both["tokens"]


@pytest.mark.gpu
def test_on_the_gpu_a_restart_loads_every_step_from_the_store(tmp_path):
    test_a_restart_on_the_same_cache_compiles_nothing(tmp_path, devices=1)


def test_a_corrupt_cache_entry_is_skipped_with_a_warning(tmp_path):
    cache = tmp_path / "xla"
    first, _ = _start(str(cache))
    entries = [f for f in cache.rglob("*") if f.is_file()]
    assert entries
    for f in entries:
        f.write_bytes(b"not an executable")
    again, stderr = _start(str(cache))
    assert "Error reading persistent compilation cache entry" in stderr
    assert "ignoring the stored step" in stderr and again["lowered"] == first["lowered"]
    assert again["compiled"] > 0 and again["tokens"] == first["tokens"]


def test_auto_keeps_the_configured_directory_and_off_writes_nothing(tmp_path):
    named = tmp_path / "named"
    _start("auto", cache_env=str(named))
    assert any(named.iterdir()), "auto did not use JAX_COMPILATION_CACHE_DIR"
    off = tmp_path / "off"
    result, _ = _start("off", cache_env=str(off))
    assert result["loaded"] == 0
    assert not off.exists() or not any(off.iterdir())


def test_the_first_generate_after_llm_compiles_nothing():
    """LLM(...) with warm-up (the GPU's default) compiles every bucket and both sampling
    variants before it returns: its first generate, greedy and sampled rows of every length
    the config allows, compiles nothing."""
    from jaxinfer import LLM, SamplingParams

    llm = LLM("tiny", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              page_size=4, warmup=True)
    before = CompileCounter.count()
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 17, 40)]
    params = [SamplingParams(max_tokens=8, temperature=t, seed=1, ignore_eos=True)
              for t in (0.0, 0.7, 0.0, 1.0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [8] * 4
    assert CompileCounter.count() == before


def test_the_store_keys_steps_by_what_shapes_them(tmp_path, monkeypatch):
    """Same code, platform, configs and shapes: the same entry, whatever the weights' values;
    another config string, shape, dtype, signature or source: another entry. An entry
    round-trips to a working executable."""
    from jaxinfer import executable_store
    from jaxinfer.executable_store import ExecutableStore

    def store(cfg="cfg", w=jnp.zeros((2, 3))):
        return ExecutableStore(tmp_path, cfg, {"w": w})

    base = store()._path("sig")
    assert store(w=jnp.ones((2, 3)))._path("sig") == base
    assert store()._path("other sig") != base
    for other in (store("cfg2"), store(w=jnp.zeros((2, 4))),
                  store(w=jnp.zeros((2, 3), jnp.bfloat16))):
        assert other._path("sig") != base
    monkeypatch.setattr(executable_store, "source_digest", lambda: "edited")
    assert store()._path("sig") != base
    monkeypatch.undo()

    compiled = jax.jit(lambda x: x * 2 + 1).trace(jnp.ones(3)).lower().compile()
    s = store()
    s.save("sig", compiled, compiled_here=True)
    assert s.load("other sig") is None
    assert list(store().load("sig")(jnp.arange(3.0))) == [1.0, 3.0, 5.0]


def test_programs_of_the_same_gemm_rows_compile_after_the_first(monkeypatch):
    """Warm-up lowers the largest steps first, compiles while it lowers, compiles the first
    program of each GEMM row count before the others of that count (they reuse its GEMMs'
    autotuning), and ends with every program compiled and runnable."""
    import threading
    import time

    from engine_util import run_alone, tiny_engine
    from jaxinfer import SamplingParams, ahead_of_time
    from jaxinfer.routes import Routes

    # decode steps of 1, 2 and 4 rows all run padded to 4 rows (the GPU pads to 8)
    engine = tiny_engine(Routes(decode_min_rows=4), max_num_batched_tokens=16, max_num_seqs=4)
    runner = engine.runner
    runner.store = None                       # lower and compile everything here
    counts, spans, lowered_at, lock = {}, [], [], threading.Lock()
    lower = type(runner).lower

    def traced_lower(self, inp, part="step"):
        low = lower(self, inp, part)
        counts[id(low)] = (low, None if part == "sample"      # the program kept: ids unique
                           else self.gemm_rows(self.prepare(inp)))
        lowered_at.append(time.perf_counter())
        return low

    compile_lowered = ahead_of_time.executable_store.compile_lowered

    def slow_compile(low, options=None):
        start = time.perf_counter()
        time.sleep(0.3)                       # long enough for the others to be lowered
        out = compile_lowered(low, options)
        with lock:
            spans.append((counts[id(low)][1], start, time.perf_counter()))
        return out

    monkeypatch.setattr(type(runner), "lower", traced_lower)
    monkeypatch.setattr(ahead_of_time.executable_store, "compile_lowered", slow_compile)
    engine.warmup(progress=False)
    assert len(spans) == len(counts) == len(runner._executables) > 2
    groups = {}
    for group, start, end in spans:
        if group is not None:
            groups.setdefault(group, []).append((start, end))
    assert sorted(groups) == [4, 16] and len(groups[4]) > 2, groups  # 3 buckets share 4
    for group, members in groups.items():
        first_end = min(members)[1]
        assert all(start >= first_end for start, _ in sorted(members)[1:]), group
    assert min(start for _, start, _ in spans) < max(lowered_at)   # compiling while lowering
    order = [rows for _, rows in counts.values() if rows is not None]
    assert order == sorted(order, reverse=True)                     # the largest steps first
    before = CompileCounter.count()
    out = run_alone(engine, {"prompt_token_ids": [5, 6, 7]},
                    SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.token_ids) == 3 and CompileCounter.count() == before


def test_steps_of_many_gemm_rows_compile_without_triton_gemms(monkeypatch):
    """Routes.triton_gemm_max_rows (test_routes): warm-up compiles the steps
    whose GEMMs have more rows with XLA's Triton GEMMs off, smaller steps and the sampling
    halves as XLA would; the engine then serves without compiling, with the same tokens."""
    from engine_util import run_alone, tiny_engine
    from jaxinfer import SamplingParams, ahead_of_time
    from jaxinfer.routes import Routes

    engine = tiny_engine(Routes(decode_min_rows=4, triton_gemm_max_rows=4),
                         max_num_batched_tokens=16, max_num_seqs=4)
    runner = engine.runner
    runner.store = None
    lower, compile_lowered = type(runner).lower, ahead_of_time.executable_store.compile_lowered
    programs, seen = {}, []

    def traced_lower(self, inp, part="step"):
        low = lower(self, inp, part)
        programs[id(low)] = (low, self.gemm_rows(self.prepare(inp)), part)
        return low

    def spy(low, options=None):
        seen.append((programs[id(low)][1:], options))
        return compile_lowered(low, options)

    monkeypatch.setattr(type(runner), "lower", traced_lower)
    monkeypatch.setattr(ahead_of_time.executable_store, "compile_lowered", spy)
    engine.warmup(progress=False)
    off = {"xla_gpu_enable_triton_gemm": False}
    assert len(seen) == len(programs) == len(runner._executables)
    for (rows, part), options in seen:
        assert (options or {}) == (off if rows > 4 and part != "sample" else {}), (rows, part)
    assert {rows > 4 for (rows, part), _ in seen if part != "sample"} == {True, False}
    assert any(part == "sample" and rows > 4 for (rows, part), _ in seen)
    before = CompileCounter.count()
    request = ({"prompt_token_ids": [5, 6, 7, 8, 9, 10]},
               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    out = run_alone(engine, *request)
    assert CompileCounter.count() == before
    assert out.token_ids == run_alone(tiny_engine(Routes(decode_min_rows=4),
                                                  max_num_batched_tokens=16, max_num_seqs=4),
                                      *request).token_ids


def test_a_step_not_compiled_ahead_takes_the_options_warmup_would_give_it(monkeypatch):
    """Without warm-up, a step whose GEMMs have more rows than routes.triton_gemm_max_rows
    is compiled ahead on first use with Triton GEMMs off, as warm-up compiles it; smaller
    steps are jitted as before, their options asked once, not at every dispatch."""
    from engine_util import run_alone, tiny_engine
    from jaxinfer import SamplingParams, ahead_of_time
    from jaxinfer.routes import Routes

    engine = tiny_engine(Routes(decode_min_rows=4, triton_gemm_max_rows=4),
                         max_num_batched_tokens=16, max_num_seqs=4)
    engine.runner.store = None
    compile_lowered, seen = ahead_of_time.executable_store.compile_lowered, []

    def spy(low, options=None):
        seen.append(options)
        return compile_lowered(low, options)

    monkeypatch.setattr(ahead_of_time.executable_store, "compile_lowered", spy)
    runner_type, asked = type(engine.runner), []
    options_of = runner_type.compiler_options
    monkeypatch.setattr(runner_type, "compiler_options", lambda self, p, part="step": (
        asked.append(p.signature) or options_of(self, p, part)))
    out = run_alone(engine, {"prompt_token_ids": [5, 6, 7, 8, 9, 10]},
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4
    # the prefill step compiled ahead; the decode steps (4 rows, padded) jitted, each
    # signature's options asked once over its three dispatches
    assert seen == [{"xla_gpu_enable_triton_gemm": False}]
    assert len(engine.runner._executables) == 1
    jitted = [sig for sig in asked if sig not in engine.runner._executables]
    assert jitted and len(jitted) == len(set(jitted)), asked


def test_a_program_that_fails_to_lower_fails_warmup_without_waiting_for_compiles(monkeypatch):
    """An error while lowering reaches the caller at once, not after the compiles already
    running (minutes each on a GPU) have finished."""
    import time

    from engine_util import tiny_engine
    from jaxinfer import ahead_of_time

    engine = tiny_engine(max_num_batched_tokens=16, max_num_seqs=4)
    engine.runner.store = None
    lower, calls = type(engine.runner).lower, []

    def failing_lower(self, inp, part="step"):
        calls.append(part)
        if len(calls) == 3:
            raise RuntimeError("lowering failed")
        return lower(self, inp, part)

    monkeypatch.setattr(type(engine.runner), "lower", failing_lower)
    monkeypatch.setattr(ahead_of_time.executable_store, "compile_lowered",
                        lambda low, options=None: time.sleep(20))
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="lowering failed"):
        engine.warmup(progress=False)
    assert time.perf_counter() - t0 < 15
