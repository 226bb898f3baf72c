"""The GPU's step programs lower for CUDA on any machine: an engine built with the GPU's routes
(Routes.choose(..., "gpu"): Pallas kernels not interpreted, the fused decode front, FP8 glue,
LoRA's kernels, unrolled layers) traces and lowers every warm-up program for the "cuda"
platform. Pallas' Triton lowering and JAX's GPU lowering rules run here without a GPU, so a
kernel's indexing or an API that the GPU path alone takes fails on the CPU; the GPU itself
then only compiles what was lowered (its tests: `-m gpu`)."""
import jax.numpy as jnp
import pytest

from checkpoints.model_state import build_model
from dense_reference import random_flat
from engine_util import TINY
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.routes import Routes
from jaxinfer.step_input import warmup_inputs

TRITON = "xla.gpu.triton"      # a Pallas kernel's custom call, as lowered for the GPU


@pytest.mark.parametrize("weights,kv_dtype,max_loras", [
    ("bf16", "auto", 2),       # LoRA's kernels beside the base model's
    ("fp8", "fp8", 0),         # FP8 linears and KV: the fused FP8 MLP and norm-quant layer
])
def test_every_warm_up_program_lowers_for_cuda(weights, kv_dtype, max_loras):
    cfg = EngineConfig(max_model_len=128, max_num_seqs=8, page_size=4,
                       max_num_batched_tokens=64, max_loras=max_loras, max_lora_rank=16,
                       kv_dtype=kv_dtype, dtype="bfloat16")
    routes = Routes.choose(cfg, "gpu")
    assert routes.pallas and not routes.interpret and routes.fused_glue
    graphdef, params = build_model(TINY, random_flat(TINY, seed=1, std=0.08), jnp.bfloat16,
                                   fp8=weights == "fp8", unroll_layers=True)
    engine = Engine(TINY, cfg, graphdef, params, routes=routes)
    runner, lowered = engine.runner, {}
    for inp in warmup_inputs(engine.buckets.all_buckets(), cfg.max_num_seqs, ("plain", "full"),
                             TINY.vocab_size, max_loras > 0):
        p = runner.prepare(inp)
        for key, part in runner.programs(p):
            if key not in lowered:
                text = runner.trace(p, part).lower(lowering_platforms=("cuda",)).as_text()
                lowered[key] = (part, text.count(TRITON), "jaxinfer_lora_expand" in text)
    # decode steps (the fused front, LoRA's kernels, the K/V write) and prefill steps
    # (ragged attention) alike run Pallas kernels on the GPU
    steps = [v for v in lowered.values() if v[0] != "sample"]
    assert len(steps) >= 4 and all(n > 0 for _, n, _ in steps), steps
    assert any(lora for _, _, lora in steps) == (max_loras > 0)
