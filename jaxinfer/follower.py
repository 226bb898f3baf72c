"""A follower process's whole life in a job of several processes (multihost.py): load the
model as the leader does, then repeat the leader's runner calls until it stops."""
from __future__ import annotations

import logging

import jax

from jaxinfer import compile_cache, multihost
from jaxinfer.buckets import Buckets
from jaxinfer.loading import load_model
from jaxinfer.runner import ModelRunner

log = logging.getLogger("jaxinfer.multihost")


def follow_model(model, engine_cfg) -> int:
    """Load `model` with the leader's EngineConfig, then follow until the leader stops;
    returns the exit status."""
    engine_cfg = engine_cfg.for_backend(jax.default_backend())
    compile_cache.enable(engine_cfg.compile_cache)
    cfg, graphdef, params, _ = load_model(model, engine_cfg)
    runner = ModelRunner(cfg, engine_cfg, graphdef, params)
    log.info("process %d follows process 0", jax.process_index())
    multihost.follow(runner, Buckets.from_config(engine_cfg).all_buckets())
    multihost.Liveness.done()
    return 0
