"""jaxinfer: a JAX/XLA inference runtime for Llama-family LLMs on NVIDIA Hopper GPUs."""
from jaxinfer.request import FinishReason, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "FinishReason"]


def __getattr__(name):
    # LLM pulls in jax; keep `import jaxinfer` (and the host-side modules) jax-free.
    if name == "LLM":
        from jaxinfer.llm import LLM
        return LLM
    raise AttributeError(name)
