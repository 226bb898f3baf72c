"""Pallas GPU kernels: each file holds a kernel, its pallas_call wrapper, a jitted entry with
input validation and a plain-jnp *_reference; attention_block.py holds the block step (and
FP8 numerics) both paged-attention kernels share, tuning.py their block sizes."""
