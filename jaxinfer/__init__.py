"""jaxinfer: a JAX/XLA inference runtime for Llama-family LLMs on NVIDIA Hopper GPUs.

Importing it adds `--xla_gpu_enable_pdl=true` to XLA_FLAGS (programmatic dependent launch:
on Hopper XLA may launch a kernel before the one it depends on has finished; a small gain in
the decode step, docs/performance.md; the CPU backend takes the flag and ignores it). XLA
reads XLA_FLAGS once, when JAX first uses a device (on the CPU a flag set later is not
parsed), so import jaxinfer before that. A flag already in XLA_FLAGS that names
xla_gpu_enable_pdl wins (`XLA_FLAGS=--xla_gpu_enable_pdl=false` turns it off).
"""
import os

from jaxinfer.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxinfer.lora import LoRARequest
from jaxinfer.request import (CompletionOutput, FinishReason, Logprob, RequestOutput,
                              SamplingParams)
from jaxinfer.structured_output import StructuredOutputsParams

PDL_FLAG = "--xla_gpu_enable_pdl=true"


def _default_xla_flags(env=os.environ) -> None:
    flags = env.get("XLA_FLAGS", "")
    if "xla_gpu_enable_pdl" not in flags:
        env["XLA_FLAGS"] = f"{flags} {PDL_FLAG}".strip()


_default_xla_flags()

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "FinishReason", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "LoRARequest", "DistributedConfig"]


def __getattr__(name):
    # LLM and AsyncLLM pull in jax; keep `import jaxinfer` (and the host-side modules) jax-free.
    if name == "LLM":
        from jaxinfer.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from jaxinfer.async_llm import AsyncLLM
        return AsyncLLM
    if name == "DistributedConfig":
        from jaxinfer.multihost import DistributedConfig
        return DistributedConfig
    raise AttributeError(name)
