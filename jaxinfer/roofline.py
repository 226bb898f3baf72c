"""What a step must move and compute, for the roofline figures: the decode suite's (bench) and
the server's live gauges (serve/metrics.py)."""
from __future__ import annotations

import jax

from jaxinfer.config import INT8_HEAD_MAX_ROWS, ModelConfig


def weight_bytes(params, cfg, batch: int, lm_head: str = "bf16") -> int:
    """Weight bytes one step reads: the embedding table only for B rows, unless it is tied
    and the head is bf16 (then the LM head reads it whole); with lm_head "auto" the int8
    head's codes and scales up to INT8_HEAD_MAX_ROWS rows, its dense copy above."""
    dense = lm_head == "auto" and batch > INT8_HEAD_MAX_ROWS   # loading.py's rule
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(path)
        nbytes = leaf.size * leaf.dtype.itemsize
        if "embed" in key and (lm_head != "bf16" or not cfg.tie_word_embeddings):
            nbytes = batch * cfg.hidden_size * leaf.dtype.itemsize
        elif "lm_head_dense" in key:
            nbytes = nbytes if dense else 0
        elif "lm_head" in key and dense:
            nbytes = 0
        total += nbytes
    return total


def step_flops(cfg: ModelConfig, rows) -> int:
    """The FLOPs of a step whose rows (start position, new tokens) each feed their new tokens
    and sample one: 2 per layer weight and token, 2 per LM-head weight and row, and
    attention's 4 per head dim, head, layer and causal (query, key) pair."""
    head = cfg.vocab_size * cfg.hidden_size
    layers = cfg.param_count() - head - (0 if cfg.tie_word_embeddings else head)
    tokens = sum(n for _, n in rows)
    pairs = sum(n * start + n * (n + 1) // 2 for start, n in rows)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
    return 2 * layers * tokens + 2 * head * len(rows) + attention
