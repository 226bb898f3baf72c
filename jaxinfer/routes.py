"""Which kernel runs each part of the step: chosen once, when the engine is built.

`Routes` is frozen and hashable: the decoder takes it as a static argument, so a change of
route is a different compiled step and nothing re-decides it while tracing. `choose` derives
it from the `EngineConfig` and the backend; tests build other routes with `replace` to
compare a fused path with the plain one it stands for.
"""
from __future__ import annotations

import dataclasses

from jaxinfer.config import EngineConfig

# GPU: XLA's GEMM at 8 rows beats its 1-row form, so small steps run padded to 8 rows.
GPU_MIN_ROWS = 8
# Decode steps of up to this many rows sum QKV's split-K products, rotate and write the new
# K/V inside the decode attention kernel (pallas_kernels/decode_qkv.py).
FRONT_MAX_ROWS = 8
QKV_PARTS = 4
# GPU: programs whose GEMMs have more rows than this compile with XLA's Triton GEMMs off, so
# cuBLAS / cuBLASLt run them untried by the autotuner. Its trials were nearly all of a cold
# start's compile (one H100, the offline 512-row FP8 config: 108.4 s of compiling with them,
# 5.4 s without), and at these rows cuBLAS ran the steps as fast (512-row decode steps
# 16.33 vs 16.51 ms, 2,048-token steps 34.85 vs 34.96 ms). Steps of up to this many rows keep
# the autotuner: their FP8 route is a Triton GEMM with the dequantization fused in
# (pallas_kernels/fp8_matmul.py, DEQUANT_MAX_M), and a bf16 row-1 step ran 5% slower without
# it (a bf16 64-row step ran 4% faster without it: the limit is FP8's).
TRITON_GEMM_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class Routes:
    attention: str = "reference"  # "pallas" (kernels) | "reference" (plain jnp)
    interpret: bool = True        # Pallas kernels in interpret mode (off the GPU)
    decode_min_rows: int = 1      # decode steps of fewer rows run padded to this many
    min_gemm_rows: int = 1        # float linears and the int8 head pad their rows to this
    fused_glue: bool = False      # RoPE + K/V write in one kernel; the fused decode front
    front_max_rows: int = 0       # the fused decode front for decode steps of <= this many rows
    qkv_parts: int = QKV_PARTS    # the front's split-K parts of QKV's projection
    front_norm: bool = True       # the RMSNorm before QKV folded into the front
    fp8_mlp: bool = False         # FP8 MLP: SiLU * up and down's quantization in one kernel
    fp8_norm_quant: bool = False  # FP8 layer: each RMSNorm fused into its quantization
    lora_kernel: bool = False     # LoRA's update of small steps in Pallas kernels (one device)
    # programs with GEMMs of more rows than this compile without XLA's Triton GEMMs (0: all
    # keep them)
    triton_gemm_max_rows: int = 0
    # the step's results written into donated buffers that keep their addresses
    # (step_program.packed_step): where XLA runs the step as a command buffer; elsewhere the
    # copy-out only adds host time
    persistent_outputs: bool = False

    @classmethod
    def choose(cls, engine: EngineConfig, backend: str) -> "Routes":
        """The measured-best routes for `engine` on `backend` ("gpu", "cpu", ...)."""
        gpu = backend == "gpu"
        pallas = engine.attention_impl == "pallas" or (engine.attention_impl == "auto" and gpu)
        return cls(attention="pallas" if pallas else "reference", interpret=not gpu,
                   decode_min_rows=GPU_MIN_ROWS if gpu else 1,
                   min_gemm_rows=GPU_MIN_ROWS if gpu else 1,
                   fused_glue=pallas, front_max_rows=FRONT_MAX_ROWS if pallas else 0,
                   fp8_mlp=gpu, fp8_norm_quant=gpu, lora_kernel=pallas and gpu,
                   triton_gemm_max_rows=TRITON_GEMM_MAX_ROWS if gpu else 0,
                   persistent_outputs=gpu)

    @property
    def pallas(self) -> bool:
        return self.attention == "pallas"

    def compiler_options(self, gemm_rows: int) -> dict:
        """XLA options for compiling a program whose GEMMs have `gemm_rows` rows
        (TRITON_GEMM_MAX_ROWS)."""
        if self.triton_gemm_max_rows and gemm_rows > self.triton_gemm_max_rows:
            return {"xla_gpu_enable_triton_gemm": False}
        return {}

    def replace(self, **kw) -> "Routes":
        return dataclasses.replace(self, **kw)
