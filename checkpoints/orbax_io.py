"""Save/restore a converted model with orbax, so the second load skips GGUF dequantization or
safetensors transposes and lands straight on the device.

Layout of a saved directory:
    jaxinfer_checkpoint.json   marker + ModelConfig + per-param dtypes (written last)
    params/                    orbax StandardCheckpointer tree of the canonical flat params
    tokenizer/                 Tokenizer.to_dir output (optional)
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from checkpoints.params import SCALE_SUFFIX, check_params, is_fp8, param_shapes
from jaxinfer.config import ModelConfig
from jaxinfer.errors import ModelLoadError

MARKER = "jaxinfer_checkpoint.json"
FORMAT = "jaxinfer-orbax-v1"


def is_orbax_dir(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save(directory: str | Path, cfg: ModelConfig, params: dict, tokenizer=None) -> None:
    """Write params (numpy or jax arrays), the config and optionally the tokenizer."""
    import orbax.checkpoint as ocp

    check_params(cfg, params, "params to save")
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)  # a half-written dir must not look valid
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", dict(params), force=True)
    checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.to_dir(directory / "tokenizer")
    (directory / MARKER).write_text(json.dumps({
        "format": FORMAT,
        "config": cfg.to_dict(),
        "fp8": is_fp8(params),
        "dtypes": {k: np.dtype(v.dtype).name for k, v in params.items()},
    }, indent=1))


def _read_marker(directory: Path) -> dict:
    if not directory.is_dir():
        raise ModelLoadError(f"checkpoint directory not found: {directory}")
    if not is_orbax_dir(directory):
        raise ModelLoadError(f"{directory} is not a jaxinfer orbax checkpoint (no {MARKER})")
    marker = json.loads((directory / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ModelLoadError(f"{directory}: unknown checkpoint format {marker.get('format')!r}")
    return marker


def restore(directory: str | Path, dtype=None):
    """(ModelConfig, params) with params as jax arrays on the default device, in their saved
    dtypes or cast to `dtype` (quantized weights, FP8 or an int8 head, and their scales keep
    theirs)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    marker = _read_marker(directory)
    cfg = ModelConfig.from_dict(marker["config"])
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    fp8 = bool(marker.get("fp8"))

    def dtype_of(name):
        saved = marker["dtypes"][name]
        keep = name + SCALE_SUFFIX in marker["dtypes"] or name.endswith(SCALE_SUFFIX)
        return saved if keep or dtype is None else dtype

    int8_head = "lm_head" + SCALE_SUFFIX in marker["dtypes"]
    target = {name: jax.ShapeDtypeStruct(shape, dtype_of(name), sharding=sharding)
              for name, shape in param_shapes(cfg, fp8, int8_head).items()}
    try:
        params = ocp.StandardCheckpointer().restore(directory / "params", target)
    except Exception as e:
        raise ModelLoadError(f"{directory}: cannot restore params ({type(e).__name__}: {e})") from None
    return cfg, dict(params)


def restore_tokenizer(directory: str | Path):
    """The Tokenizer saved beside the params, or None if none was saved."""
    from jaxinfer.tokenizer import Tokenizer

    tok_dir = Path(directory) / "tokenizer"
    return Tokenizer.from_dir(tok_dir) if tok_dir.is_dir() else None
