"""Random LoRA adapters in PEFT's format for the tests (checkpoints.synthetic_lora)."""
from checkpoints.synthetic_lora import write_random_adapter as write_adapter  # noqa: F401
