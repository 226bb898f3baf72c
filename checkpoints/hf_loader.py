"""Load a Hugging Face model directory (config.json + *.safetensors, possibly sharded) into
(ModelConfig, canonical flat params). nn.Linear weights are [out, in] there; ours are [in, out].
HF checkpoints already use the rotate_half RoPE layout, so Q/K rows need no permutation.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from checkpoints.lazy import FileTensor, Stacked
from checkpoints.params import check_params
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ModelLoadError

# HF name after "model.layers.N." -> (canonical name, is a linear weight)
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.weight": ("wo", True),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # a buffer old checkpoints saved


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    return files


def _read_tensors(files: list[Path], cfg: ModelConfig, dtype, lazy: bool = False):
    from safetensors import safe_open

    layers: dict[str, list] = {}
    params: dict[str, np.ndarray] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="numpy")
        except Exception as e:
            raise ModelLoadError(f"{file} is not a valid safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                if lazy:
                    def tensor(transpose, name=name, shape=f.get_slice(name).get_shape()):
                        return FileTensor(file, name, shape, dtype, transpose)
                else:
                    def tensor(transpose, w=f.get_tensor(name)):
                        return np.ascontiguousarray(w.T if transpose else w, dtype)
                _place(name, tensor, cfg, layers, params)
    for key, per_layer in layers.items():
        if len(per_layer) != cfg.num_layers or any(x is None for x in per_layer):
            raise ModelLoadError(f"checkpoint has {key} for the wrong set of layers "
                                 f"(config says {cfg.num_layers})")
        params[key] = Stacked(per_layer) if lazy else np.stack(per_layer)
    return params


def _place(name, tensor, cfg, layers, params):
    """File tensor `name` into `layers` / `params`; tensor(transpose) gives it, as [in, out]
    for a linear (transpose=True)."""
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_TENSORS:
        key, linear = _LAYER_TENSORS[m.group(2)]
        idx = int(m.group(1))
        slots = layers.setdefault(key, [None] * cfg.num_layers)
        if idx >= len(slots):
            raise ModelLoadError(f"{name}: layer {idx} but config says {cfg.num_layers} layers")
        slots[idx] = tensor(linear)
    elif name == "model.embed_tokens.weight":
        params["embed"] = tensor(False)                              # [V, E]
    elif name == "model.norm.weight":
        params["final_norm"] = tensor(False)
    elif name == "lm_head.weight":
        if not cfg.tie_word_embeddings:  # tied checkpoints sometimes store a copy anyway
            params["lm_head"] = tensor(True)                         # [E, V]
    elif not _IGNORED.fullmatch(name):
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (not a supported "
                             f"{cfg.architecture} weight)")


def load_hf_dir(path: str | Path, dtype=np.float32, lazy: bool = False):
    """(ModelConfig, params) from an HF model dir; params are numpy arrays of `dtype`
    (np.float32 or ml_dtypes.bfloat16), or with lazy=True checkpoints.lazy tensors that read
    only the slices asked for (a process of a tensor-parallel job reads its own shards)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory not found: {directory}")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{directory} has no config.json (not a Hugging Face model dir)")
    cfg = ModelConfig.from_json(directory / "config.json")
    params = _read_tensors(safetensors_files(directory), cfg, dtype, lazy)
    check_params(cfg, params, str(directory))
    return cfg, params
