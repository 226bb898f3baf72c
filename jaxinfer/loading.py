"""Model source + EngineConfig -> (ModelConfig, graphdef, params, tokenizer)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.config import EngineConfig
from jaxinfer.params import build_model


def load_model(model: str, engine_cfg: EngineConfig):
    from checkpoints import load_checkpoint

    dtype = jnp.dtype(engine_cfg.dtype)
    cfg, flat, tokenizer = load_checkpoint(model, dtype=dtype, seed=engine_cfg.seed)
    graphdef, params = build_model(cfg, flat, dtype, fp8=engine_cfg.weights == "fp8",
                                   unroll_layers=engine_cfg.unroll_layers)
    return cfg, graphdef, params, tokenizer
