"""What every bench suite shares: the results file (its format: bench/README.md), timing, and a
ModelRunner built from the CLI's engine flags with synthetic decode inputs.

Results file: {"suite", "device", "jax", "git", "date", "command", "ceilings", "rows", ...}.
`save` rewrites it after every batch of rows, so a run cut short still leaves its numbers.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.args import engine_argv  # noqa: F401 (the suites' child processes' flags)


def git_sha(override: str | None = None) -> str:
    """`--git` wins (a copy of the tree may have no .git), else `git rev-parse HEAD`."""
    if override:
        return override
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"


def device_name() -> str:
    d = jax.devices()[0]
    return d.device_kind if d.platform == "gpu" else f"cpu ({os.cpu_count()} cores)"


def new_result(args, **extra) -> dict:
    """A result file's header for the suite `args` runs (bench.cli sets args.suite and
    args.command). XLA_FLAGS, when set, is recorded under "env"."""
    env = {k: os.environ[k] for k in ("XLA_FLAGS",) if os.environ.get(k)}
    command = getattr(args, "command", None) or " ".join(sys.argv)
    return {"suite": args.suite, "device": device_name(), "jax": jax.__version__,
            "git": git_sha(args.git), "date": str(datetime.date.today()), "command": command,
            **({"env": env} if env else {}), **extra, "rows": []}


def emit_row(result: dict, row: dict) -> dict:
    """Append one row to result and echo it as a JSON line."""
    result["rows"].append(row)
    print(json.dumps(row), flush=True)
    return row


def save(result: dict, path: str | Path, rows: list[dict] = ()) -> None:
    """Append rows (echoed as JSON lines) and rewrite the file atomically."""
    for r in rows:
        emit_row(result, r)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def timed(fn, reps: int = 10, min_s: float = 5e-3) -> float:
    """Seconds per call of fn() (which must block on its own result): median over reps of
    back-to-back batches lasting >= min_s, after one warm-up call."""
    fn()
    t = time.perf_counter()
    fn()
    n = max(1, math.ceil(min_s / max(time.perf_counter() - t, 1e-6)))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n)
    return statistics.median(samples)


def print_table(rows: list[dict], keys: list[str]) -> None:
    """A plain aligned table of `keys` over `rows` (missing values blank)."""
    cells = [[_fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max([len(k)] + [len(c[i]) for c in cells]) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def progress(iterable, desc: str, total: int | None = None, unit: str = "case"):
    """A tqdm bar on stderr; iterable None gives a manual bar (`bar.update(n)`)."""
    from tqdm import tqdm

    # Off a terminal (CI logs) redraw rarely: the log stays readable.
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr,
                mininterval=0.1 if sys.stderr.isatty() else 10.0)


_SHORT = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "fp8"}


def dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    return _SHORT.get(name, name)


def weights_name(engine) -> str:
    """The linear weights' format: fp8, or the compute dtype they are held in."""
    return "fp8" if engine.weights == "fp8" else dtype_name(engine.dtype)


def engine_config(args):
    """The EngineConfig of the engine flags in `args`, its dtype resolved for this backend."""
    from jaxinfer.args import engine_config_from_args
    from jaxinfer.errors import ConfigError

    if getattr(args, "lora", None):
        raise ConfigError("the bench suites load no LoRA adapters (--lora); `jaxinfer bench "
                          "lora` writes its own, and --max-loras measures LoRA on without them")
    return engine_config_from_args(args).for_backend(jax.default_backend())


# --- a ModelRunner from the CLI's engine flags, and synthetic decode inputs ---------------

def load_runner(args, *, max_num_seqs: int, max_len: int, pairs=(), kv_budget_gb=None):
    """(ModelRunner, ModelConfig, graphdef) for args.model under the CLI's engine flags, sized
    for `max_num_seqs` rows of up to `max_len` tokens. With `pairs` ((B, C) cases) the KV pool
    holds the largest case that fits in kv_budget_gb GB."""
    from jaxinfer.kv_cache import kv_page_bytes
    from jaxinfer.loading import load_model
    from jaxinfer.runner import ModelRunner

    engine = engine_config(args)
    engine = engine.replace(max_num_seqs=max_num_seqs,
                            max_model_len=max(max_len, engine.max_model_len))
    cfg, graphdef, params, _ = load_model(args.model, engine)
    if pairs:
        budget = int((kv_budget_gb or 1e9) * 1e9 // kv_page_bytes(cfg, engine))
        fits = [n for n in (b * -(-(c + 1) // engine.page_size) for b, c in pairs)
                if n <= budget]
        if not fits:
            raise ValueError(f"no (batch, context) case fits in {kv_budget_gb} GB of KV")
        engine = engine.replace(num_pages=1 + max(fits))
    return ModelRunner(cfg, engine, graphdef, params), cfg, graphdef


def decode_input(cfg, engine, batch: int, context: int, rng):
    """A StepInput of the decode bucket (B = T = batch): row b decodes a random token at
    position context-1 over its own pages (1 + b * pages_per_row ...; page 0 stays reserved),
    sampling greedy."""
    from jaxinfer.kv_cache import AttentionMetadata
    from jaxinfer.step_input import StepInput
    from jaxinfer.sampling import SamplingArrays

    s, width = engine.page_size, engine.pages_per_seq
    per_row = -(-context // s)
    rows = np.arange(batch, dtype=np.int32)
    table = np.zeros((batch, width), np.int32)
    table[:, :per_row] = 1 + rows[:, None] * per_row + np.arange(per_row, dtype=np.int32)
    pos = np.full(batch, context - 1, np.int32)
    slots = table[rows, pos // s] * s + pos % s
    md = AttentionMetadata(pos, slots, rows, table, pos + 1,
                           np.arange(batch + 1, dtype=np.int32), decode_only=True)
    tokens = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
    return StepInput(tokens, md, rows, SamplingArrays.from_params([], [], batch_size=batch),
                     np.zeros(engine.max_num_seqs, np.int32), np.full(batch, -1, np.int32))


@functools.partial(jax.jit, donate_argnums=0)
def _fill(kv):
    """Every K/V element (and FP8 scale) replaced by a cheap hash of its index, in place:
    one elementwise kernel per array, no full-size temporaries (the pool may be 50 GB).
    KVLayers: each layer's arrays salted by the layer, so layers hold different values."""
    from jaxinfer.kv_cache import KVLayers

    if isinstance(kv, KVLayers):
        return KVLayers(tuple(_fill_cache(c, 4 * i) for i, c in enumerate(kv.layers)))
    return _fill_cache(kv, 0)


def _fill_cache(kv, salt: int):
    def noise(x, salt):
        # Per-axis iotas: a flat one would overflow 32 bits on a pool of > 4G elements.
        h = jnp.uint32(salt)
        for d, mult in zip(range(x.ndim), (2654435761, 2246822519, 3266489917, 668265263,
                                          374761393)):
            h = (h ^ jax.lax.broadcasted_iota(jnp.uint32, x.shape, d)) * jnp.uint32(mult)
        h = h ^ (h >> 15)
        return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))              # [0, 1)

    k = (2 * noise(kv.k, salt + 1) - 1).astype(kv.k.dtype)
    v = (2 * noise(kv.v, salt + 2) - 1).astype(kv.v.dtype)
    if kv.k_scale is None:
        return dataclasses.replace(kv, k=k, v=v)
    return dataclasses.replace(kv, k=k, v=v, k_scale=(0.5 + noise(kv.k_scale, salt + 3)) / 64,
                               v_scale=(0.5 + noise(kv.v_scale, salt + 4)) / 64)


def fill_kv(kv):
    """bench's K/V contents (_fill) for a pool of either form (jaxinfer/kv_cache.py)."""
    return jax.block_until_ready(_fill(kv))


def burst(runner, inp, n: int) -> tuple[float, float]:
    """Dispatch n steps back to back (the runner's executable, threading the donated cache),
    then block once: (seconds the host took to dispatch them, seconds until all were done)."""
    t0 = time.perf_counter()
    kv = runner.kv
    for i in range(n):
        kv, out, _ = runner.dispatch(kv, inp, i)
    t1 = time.perf_counter()
    runner.kv = jax.block_until_ready(kv)
    jax.block_until_ready(out)
    return t1 - t0, time.perf_counter() - t0


def pipelined_step_s(runner, inp, reps: int, n: int = 8) -> float:
    """Seconds per step in a stream of steps dispatched back to back (no per-step host round
    trip): (a burst of 2n steps - a burst of n) / n, so what a burst pays once (the first
    dispatch before the device has work, the final block) cancels. Where noise makes the
    difference not positive (tiny CPU models), the 2n burst's time / 2n."""
    short = timed(lambda: burst(runner, inp, n), reps)
    long = timed(lambda: burst(runner, inp, 2 * n), reps)
    return (long - short) / n if long > short else long / (2 * n)
