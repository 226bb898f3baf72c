"""Random LoRA adapters written in PEFT's format (adapter_config.json +
adapter_model.safetensors) for any model config, without peft itself."""
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxinfer.lora import module_shapes

_PARENT = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
           "gate": "mlp", "up": "mlp", "down": "mlp"}


def write_adapter(path, cfg, *, rank=8, alpha=16, seed=0, modules=tuple(_PARENT), std=0.1,
                  layers=None, config_extra=None) -> Path:
    """A random adapter of `rank` on `modules` (all layers, or `layers`) in directory `path`."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes, tensors = module_shapes(cfg), {}
    for layer in range(cfg.num_layers) if layers is None else layers:
        for m in modules:
            din, dout = shapes[m]
            key = f"base_model.model.model.layers.{layer}.{_PARENT[m]}.{m}_proj"
            tensors[f"{key}.lora_A.weight"] = (std * rng.standard_normal((rank, din))).astype(
                np.float32)
            tensors[f"{key}.lora_B.weight"] = (std * rng.standard_normal((dout, rank))).astype(
                np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
            "target_modules": [f"{m}_proj" for m in modules], "use_rslora": False,
            "use_dora": False, "modules_to_save": None, **(config_extra or {})}
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return path
