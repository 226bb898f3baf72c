"""Shared helpers for engine tests: a tiny random-weight engine, drivers, JSONL files."""
import json
import socket

import jax.numpy as jnp
import numpy as np

from dense_reference import random_flat
from jaxinfer.config import EngineConfig, standard_config
from jaxinfer.engine import Engine
from checkpoints.model_state import build_model

TINY = standard_config("tiny")
_TINY_MODEL = {}


def tiny_model():
    """(graphdef, params) of the tiny twin with random weights large enough that greedy
    outputs vary by prompt (built once per process)."""
    if not _TINY_MODEL:
        _TINY_MODEL["m"] = build_model(TINY, random_flat(TINY, seed=11, std=0.08), jnp.float32)
    return _TINY_MODEL["m"]


def tiny_engine(routes=None, **engine_kw) -> Engine:
    """The tiny twin (tiny_model) in an engine; routes: the kernels' routes (None: chosen
    from the config and the backend)."""
    graphdef, params = tiny_model()
    cfg = EngineConfig(**{"max_model_len": 128, "max_num_seqs": 8,
                          "max_num_batched_tokens": 64, "page_size": 4, **engine_kw})
    return Engine(TINY, cfg, graphdef, params, routes=routes)


def random_prompts(n, lo=3, hi=40, seed=0, vocab=TINY.vocab_size):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, rng.integers(lo, hi)).tolist()}
            for _ in range(n)]


def run_staggered(engine, prompts, params, arrivals):
    """Add prompt i before step arrivals[i]; step until done. Returns outputs by index."""
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    ids, final, step = {}, {}, 0
    while order or engine.has_unfinished_requests():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            if out.finished:
                final[ids[out.request_id]] = out
        step += 1
    return [final[i] for i in range(len(prompts))]


def run_alone(engine, prompt, params):
    return run_staggered(engine, [prompt], [params], [0])[0]


def count_scheduled_tokens(engine) -> list[int]:
    """A list that gets each later step's scheduled token count (prefill and decode)."""
    fed = []
    schedule = engine.scheduler.schedule

    def counted(*args, **kw):
        out = schedule(*args, **kw)
        fed.append(out.num_tokens)
        return out
    engine.scheduler.schedule = counted
    return fed


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                            for ln in lines))


def read_jsonl(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]
