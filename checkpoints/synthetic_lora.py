"""Random LoRA adapters at a real model's shapes, written in PEFT's format
(adapter_config.json + adapter_model.safetensors, the tensor names peft's save_pretrained
uses): for the LoRA benchmark and tests. Honest for speed, never for quality."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxinfer.config import ModelConfig
from jaxinfer.lora import MODULES, module_shapes

_PARENT = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
           "gate": "mlp", "up": "mlp", "down": "mlp"}


def write_random_adapter(path, cfg: ModelConfig, *, rank: int = 8, alpha: float = 16,
                         seed: int = 0, modules=MODULES, std: float = 0.1, layers=None,
                         dtype=np.float32, config_extra: dict | None = None) -> Path:
    """A random adapter of `rank` on `modules` (every layer, or those in `layers`), A and B
    drawn from N(0, std), in directory `path` (created)."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes, tensors = module_shapes(cfg), {}
    for layer in range(cfg.num_layers) if layers is None else layers:
        for m in modules:
            din, dout = shapes[m]
            key = f"base_model.model.model.layers.{layer}.{_PARENT[m]}.{m}_proj"
            for which, shape in (("A", (rank, din)), ("B", (dout, rank))):
                tensors[f"{key}.lora_{which}.weight"] = (
                    std * rng.standard_normal(shape, np.float32)).astype(dtype)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
            "target_modules": [f"{m}_proj" for m in modules], "use_rslora": False,
            "use_dora": False, "modules_to_save": None, **(config_extra or {})}
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return path
