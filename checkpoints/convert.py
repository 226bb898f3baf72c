"""`jaxinfer convert SRC DST`: any supported source -> the fast-loading orbax form."""
from __future__ import annotations

from pathlib import Path

from jaxinfer.errors import ModelLoadError


def convert(src: str, dst: str | Path, weights: str = "bf16") -> None:
    """Load SRC, optionally quantize its decoder linears to FP8, write DST with orbax.

    bf16 keeps float weights as bfloat16 (half of float32's bytes; compute casts as needed)."""
    from checkpoints import load_checkpoint, orbax_io
    from checkpoints.fp8 import quantize_params

    if weights not in ("bf16", "fp8"):
        raise ModelLoadError(f"weights must be 'bf16' or 'fp8', got {weights!r}")
    cfg, params, tokenizer = load_checkpoint(src, dtype="bfloat16")
    if weights == "fp8":
        params = quantize_params(params)
    orbax_io.save(dst, cfg, params, tokenizer)
