"""The draft program of the on-device proposers (speculative.py): self-speculation (the
model's first layers) and a draft model (all of its layers, draft_model.py) draft k greedy
tokens per row in one jitted program; ModelRunner.draft runs it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.kv_cache import AttentionMetadata


def draft_tokens(graphdef, routes, treedef, leaves, kv, tokens, positions, page_table, seq_lens,
                  lengths, lora, lora_index, *, k, num_layers, page_size, kv_sharding=None):
    """Self-speculation's draft (speculative.py): k greedy tokens per row from the model's
    first `num_layers` layers and its LM head, one decode step of those layers per token,
    all in one program. Row b feeds tokens[b] at positions[b] (its context, seq_lens[b] - 1
    tokens, is in the cache), then each drafted token; the first lengths[b] fed tokens' K/V
    of those layers is written (what the verify step writes again, the same values), the
    rest nowhere. Padding rows: seq_lens 0, lengths 0. Returns (kv, [B, k] tokens)."""
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    b, width = page_table.shape
    rows = jnp.arange(b, dtype=jnp.int32)

    def one(j, carry):
        kv, token, out = carry
        pos = positions + j
        page = page_table[rows, jnp.minimum(pos // page_size, width - 1)]
        md = AttentionMetadata(pos, jnp.where(j < lengths, page * page_size + pos % page_size,
                                              -1),
                               rows, page_table, jnp.where(seq_lens > 0, seq_lens + j, 0),
                               jnp.arange(b + 1, dtype=jnp.int32), decode_only=True)
        h, kv = model(token, kv, md, routes, None if lora is None else (lora, lora_index),
                      num_layers=num_layers)
        if kv_sharding is not None:
            kv = jax.lax.with_sharding_constraint(kv, kv_sharding)
        token = jnp.argmax(model.logits(h, routes), axis=-1).astype(jnp.int32)
        return kv, token, out.at[:, j].set(token)

    kv, _, out = jax.lax.fori_loop(0, k, one, (kv, tokens, jnp.zeros((b, k), jnp.int32)))
    return kv, out
