"""Checkpoint files written by tests: Hugging Face model dirs of random weights."""
import json

import numpy as np
from safetensors.numpy import save_file

from checkpoints.params import param_shapes
from jaxinfer.config import STANDARD_CONFIGS_DIR, ModelConfig

HF_LINEAR = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
HF_VECTOR = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
             "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}


def tiny_hf_config(**overrides):
    d = json.loads((STANDARD_CONFIGS_DIR / "tiny.json").read_text())
    d.update(overrides)
    return d


def write_hf_dir(directory, cfg_dict, rng, dtype=np.float32, shards=1, std=1.0):
    """An HF-format model dir (config.json, safetensors in `shards` files) of normal random
    weights (scaled by `std`); returns the canonical params it holds."""
    cfg = ModelConfig.from_hf_dict(cfg_dict)
    params = {k: (std * rng.standard_normal(s)).astype(np.float32) for k, s in param_shapes(cfg).items()}
    tensors = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if "lm_head" in params:
        tensors["lm_head.weight"] = params["lm_head"].T
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}."
        tensors.update({pre + v + ".weight": params[k][layer].T for k, v in HF_LINEAR.items()})
        tensors.update({pre + v: params[k][layer] for k, v in HF_VECTOR.items() if k in params})
    tensors = {k: np.ascontiguousarray(v).astype(dtype) for k, v in tensors.items()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg_dict))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k] for k in part}, str(directory / shard))
        weight_map.update(dict.fromkeys(part, shard))
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {k: v.astype(dtype).astype(np.float32) for k, v in params.items()}
