"""SamplingParams as the host sees them in a step: which variant a row needs (`plain` or
`full`, sampling.py) and its columns of SamplingArrays, packed once per SamplingParams object
and joined per step (SamplingArrays.from_params), and the penalty windows' context ids."""
from __future__ import annotations

import weakref

import numpy as np

from jaxinfer.request import SamplingParams

MIN_TEMPERATURE = 1e-5  # below this a row is greedy: dividing by it would overflow the logits
COLUMNS = 13                   # columns_of's
_ROWS: dict[int, bytes] = {}   # id(SamplingParams) -> its columns_of, while it lives


def columns_of(p: SamplingParams) -> bytes:
    """p's columns of SamplingArrays as float64 bytes (exact: every value is a small integer or
    a float): temperature, top_k, top_p, min_p, the three penalties, num_logprobs, the seed's
    high and low 32 bits, has_seed, uses_penalty, needs_full. Computed once per object (the
    dataclass is frozen) and kept by its id until it is collected, outside the object, so
    that vars(p) stays its fields."""
    row = _ROWS.get(id(p))
    if row is None:
        seed = p.seed or 0
        row = np.array((p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                        p.presence_penalty, p.frequency_penalty,
                        -1 if p.logprobs is None else p.logprobs, seed >> 32, seed & 0xFFFFFFFF,
                        p.seed is not None, uses_penalty(p), needs_full(p)),
                       np.float64).tobytes()
        _ROWS[id(p)] = row
        weakref.finalize(p, _ROWS.pop, id(p), None)
    return row


def uses_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_full(p: SamplingParams) -> bool:
    """Whether a row needs the `full` variant (anything beyond greedy argmax)."""
    return (p.temperature >= MIN_TEMPERATURE or p.logprobs is not None or uses_penalty(p)
            or p.min_tokens > 0 or p.structured_outputs is not None
            or p.prompt_logprobs is not None)


def penalty_window(users, full: bool, token_ids, generated_counts, batch_size, window):
    """[B, W] last-W context ids (-1 padded) and [B] output start of the rows `users` (those
    with a penalty); W = 0 (the `plain` variant) unless `full` (some row is not greedy, or
    wants logprobs or a penalty)."""
    width = window if full else 0
    tokens = np.full((batch_size, width), -1, np.int32)
    out_start = np.zeros(batch_size, np.int32)
    for b in users:
        if token_ids is None or token_ids[b] is None:
            raise ValueError(f"row {b} uses a penalty but no token_ids were given for it")
        ctx = np.asarray(token_ids[b][-window:], np.int32)
        tokens[b, :len(ctx)] = ctx
        out_start[b] = max(len(ctx) - int(generated_counts[b]), 0)
    return tokens, out_start
