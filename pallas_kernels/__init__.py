"""Pallas GPU kernels: each file holds a kernel, its pallas_call wrapper, a jitted entry with input validation and a plain-jnp *_reference."""
