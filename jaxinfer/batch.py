"""SchedulerOutput -> the step's input arrays, padded to one bucket. Plain numpy, no jax: the
engine moves them to the device (one transfer per step) and wraps them in
`kv_cache.AttentionMetadata`, whose fields these mirror one for one.

Layout: row b's new tokens are contiguous, tokens query_start[b]:query_start[b+1], at positions
start_pos .. seq_len - 1 of its sequence. Each token's K/V goes to slot page*S + pos % S of the
page its position falls in, page = the row's page_ids[pos // S].

Padding, chosen so padded work is harmless without masks in the model:
  padded tokens   token 0, position 0, slot -1 (writes nothing), token_seq 0;
  padded rows     seq_lens 0 (attend to nothing), page table all page 0 (reserved, valid
                  memory), query_start repeats the last real offset (zero new tokens),
                  logits_index 0.
Everything is built with whole-array numpy ops: no per-token Python loop.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxinfer.buckets import Bucket
from jaxinfer.scheduler_output import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class StepArrays:
    tokens: np.ndarray        # [T] i32  token ids fed this step (padding: 0)
    positions: np.ndarray     # [T] i32  position in its sequence (padding: 0)
    slot_mapping: np.ndarray  # [T] i32  page * S + slot (padding: -1)
    token_seq: np.ndarray     # [T] i32  row of each token (padding: 0)
    page_table: np.ndarray    # [B, pages_per_seq] i32  (padding: page 0)
    seq_lens: np.ndarray      # [B] i32  context length incl. this step's tokens (padding: 0)
    query_start: np.ndarray   # [B+1] i32  cumulative new-token counts
    logits_index: np.ndarray  # [B] i32  index in T of each row's last token (padding: 0);
                              # verify buckets: [T] = 0 .. T-1, a token sampled at each
    samples: np.ndarray       # [B] bool  row yields a sampled token (padding: False)
    decode_only: bool         # static: T == B and every real row has one token
    request_ids: tuple[str, ...]  # request of each real row; rows beyond it are padding

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)


def prepare(output: SchedulerOutput, bucket: Bucket, page_size: int) -> StepArrays:
    rows = output.rows
    n_rows, n_tok = len(rows), output.num_tokens
    T, B, W = bucket.num_tokens, bucket.num_seqs, bucket.pages_per_seq
    if not 0 < n_rows <= B or n_tok > T or output.max_pages > W:
        raise ValueError(f"step of {n_tok} tokens, {n_rows} rows, {output.max_pages} pages per "
                         f"row does not fit bucket {bucket}")
    if bucket.decode_only and n_tok != n_rows:
        raise ValueError("a decode bucket needs exactly one token per row")

    # The rows' columns in one transposition (rows are named tuples), then whole-array ops.
    request_ids, token_ids, starts, page_ids, samples_ = zip(*rows)
    q_len = np.fromiter(map(len, token_ids), np.int32, n_rows)
    start = np.array(starts, np.int32)
    query_start = np.full(B + 1, n_tok, np.int32)
    query_start[0] = 0
    query_start[1:n_rows + 1] = np.cumsum(q_len)

    # Every row's pages (int32 arrays) into the table at once: the cells a row's pages fill
    # are, in row-major order, the concatenation's order.
    n_pages = np.fromiter(map(len, page_ids), np.int64, n_rows)
    page_table = np.zeros((B, W), np.int32)
    page_table[:n_rows][np.arange(W) < n_pages[:, None]] = np.concatenate(page_ids)

    seq = np.repeat(np.arange(n_rows, dtype=np.int32), q_len)          # [n_tok]
    pos = start[seq] + np.arange(n_tok, dtype=np.int32) - query_start[seq]
    page_index = np.minimum(pos // page_size, W - 1)
    page = page_table[seq, page_index]
    if np.any(page == 0) or np.any(pos // page_size >= W):
        raise ValueError("a scheduled token falls outside its request's pages")

    def padded(values, fill):
        out = np.full(T, fill, np.int32)
        out[:n_tok] = values
        return out

    seq_lens = np.zeros(B, np.int32)
    seq_lens[:n_rows] = start + q_len
    if bucket.verify:
        logits_index = np.arange(T, dtype=np.int32)
    else:
        logits_index = np.zeros(B, np.int32)
        logits_index[:n_rows] = query_start[1:n_rows + 1] - 1
    samples = np.zeros(B, bool)
    samples[:n_rows] = samples_
    return StepArrays(
        tokens=padded(np.fromiter(itertools.chain.from_iterable(token_ids), np.int32, n_tok), 0),
        positions=padded(pos, 0),
        slot_mapping=padded(page * page_size + pos % page_size, -1),
        token_seq=padded(seq, 0),
        page_table=page_table,
        seq_lens=seq_lens,
        query_start=query_start,
        logits_index=logits_index,
        samples=samples,
        decode_only=bucket.decode_only,
        request_ids=request_ids)
