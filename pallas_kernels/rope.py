"""Rotary position embedding (RoPE): the rotation every kernel that rotates q or k reproduces,
and the model applies where no kernel does."""
from __future__ import annotations

import jax.numpy as jnp


def apply_rope(x, cos, sin):
    """x [T, N, D]; cos/sin [T, D/2]. rotate_half convention (HF), in f32, rounded back to
    x's dtype."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
