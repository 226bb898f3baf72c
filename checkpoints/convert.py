"""`jaxinfer convert SRC DST`: any supported source -> the fast-loading orbax form."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxinfer.errors import ModelLoadError


def convert(src: str, dst: str | Path, weights: str = "bf16", calibrate: bool = False,
            calibration_windows: int | None = None, progress: bool = False,
            lm_head: str = "bf16") -> None:
    """Load SRC, optionally quantize its decoder linears to FP8, write DST with orbax.

    bf16 keeps float weights as bfloat16 (half of float32's bytes; compute casts as needed).
    fp8 rounds to nearest (checkpoints/fp8.py), or with calibrate=True rounds with error
    compensation on calibration text (checkpoints/calibrate.py: same format and scales,
    better agreement with bf16; about a minute on a CPU for SmolLM2) over
    calibration_windows windows of 512 tokens (None: calibrate.DEFAULT_WINDOWS). lm_head
    "int8": the LM head as int8 codes per vocab row (load with lm_head="int8"), calibrated
    the same way with calibrate=True, else rounded to nearest."""
    from checkpoints import load_checkpoint, orbax_io
    from checkpoints.fp8 import quantize_int8_linear, quantize_params
    from checkpoints.params import SCALE_SUFFIX

    if weights not in ("bf16", "fp8"):
        raise ModelLoadError(f"weights must be 'bf16' or 'fp8', got {weights!r}")
    if lm_head not in ("bf16", "int8"):
        raise ModelLoadError(f"lm_head must be 'bf16' or 'int8', got {lm_head!r}")
    if calibrate and weights != "fp8":
        raise ModelLoadError("--calibrate applies to --weights fp8 only")
    if calibration_windows is None:
        from checkpoints.calibrate import DEFAULT_WINDOWS   # (`calibrate` is the flag here)
        calibration_windows = DEFAULT_WINDOWS
    if calibration_windows < 1:
        raise ModelLoadError(f"calibration windows must be >= 1, got {calibration_windows}")
    cfg, params, tokenizer = load_checkpoint(src, dtype="bfloat16")
    if weights == "fp8" and calibrate:
        from checkpoints.calibrate import calibrated_quantize_params

        try:
            params = calibrated_quantize_params(cfg, params, tokenizer,
                                                num_windows=calibration_windows,
                                                progress=progress,
                                                int8_head=lm_head == "int8")
        except ValueError as e:   # no tokenizer; more windows than the calibration text holds
            raise ModelLoadError(f"calibration failed: {e}") from None
    elif weights == "fp8":
        params = quantize_params(params)
    if lm_head == "int8" and "lm_head" + SCALE_SUFFIX not in params:
        w = params.pop("lm_head") if "lm_head" in params else params["embed"].T
        codes, scale = quantize_int8_linear(w)
        params["lm_head"], params["lm_head" + SCALE_SUFFIX] = np.asarray(codes), np.asarray(scale)
    orbax_io.save(dst, cfg, params, tokenizer)
