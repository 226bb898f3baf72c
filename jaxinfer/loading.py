"""Model source + EngineConfig -> (ModelConfig, graphdef, params, tokenizer): the runtime's one
entry into checkpoints/.

With tensor_parallel > 1 the weights go straight to their shards: an HF model dir's
safetensors are read slice by slice where this process's devices need them (in a job of
several processes each reads only its own shards), other file checkpoints are read to host
memory and each device receives only its slices; synthetic weights (standard shapes) are
generated already sharded, so no device ever holds a whole model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from checkpoints import load_checkpoint
from checkpoints.model_state import build_model
from jaxinfer import config
from jaxinfer.config import EngineConfig
from jaxinfer.sharding import make_layout


def resolve_unroll(unroll_layers: bool | None) -> bool:
    """EngineConfig.unroll_layers with None (auto) resolved: unrolled on a GPU."""
    return jax.default_backend() == "gpu" if unroll_layers is None else bool(unroll_layers)


def load_model(model: str, engine_cfg: EngineConfig):
    engine_cfg = engine_cfg.for_backend(jax.default_backend())
    dtype = jnp.dtype(engine_cfg.dtype)
    cfg, flat, tokenizer = load_checkpoint(model, dtype=dtype, seed=engine_cfg.seed,
                                           tensor_parallel=engine_cfg.tensor_parallel,
                                           fp8=engine_cfg.weights == "fp8",
                                           lazy=engine_cfg.tensor_parallel > 1)
    layout = make_layout(cfg, engine_cfg.tensor_parallel)
    graphdef, params = build_model(cfg, flat, dtype, fp8=engine_cfg.weights == "fp8",
                                   unroll_layers=resolve_unroll(engine_cfg.unroll_layers),
                                   layout=layout,
                                   consume=True, int8_head=engine_cfg.lm_head != "bf16",
                                   dense_head_above=(config.INT8_HEAD_MAX_ROWS
                                                     if engine_cfg.lm_head == "auto" else None))
    return cfg, graphdef, params, tokenizer
