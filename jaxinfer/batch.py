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


def _fill(table: np.ndarray, views) -> None:
    """Each row of `table` from the start: that row's pages (int32 arrays). Every row's cells
    at once: the cells the pages fill are, in row-major order, the concatenation's order."""
    lens = np.fromiter(map(len, views), np.int64, len(views))
    table[np.arange(table.shape[1]) < lens[:, None]] = np.concatenate(views)


class PageTables:
    """Each step's page table made from the last one of its shape. A row whose pages are the
    same array as a row's last time (`PageList.view`: the same object until the request's
    pages change) is copied from that row, and only the others are filled from their pages:
    a decode row gets a new page every S steps, so at 512 rows of ~100 pages a step fills
    ~1/S of its rows instead of all of them. Rows that kept their place are found by a
    positional comparison; when many moved (a request that finished mid-batch shifts the
    rows after it), by each view's id. The last views are kept, so their ids stay theirs."""

    def __init__(self):
        self._last: dict = {}   # (B, W) -> (views, table)

    def build(self, views, shape: tuple[int, int]) -> np.ndarray:
        """The [B, W] table of `views` (one per real row; padding rows are page 0)."""
        n = len(views)
        last = self._last.get(shape)
        if last is None:
            table = np.zeros(shape, np.int32)
            _fill(table[:n], views)
        else:
            old_views, old = last
            moved = [i for i, (a, b) in enumerate(zip(views, old_views)) if a is not b]
            moved += range(min(n, len(old_views)), n)
            if len(moved) <= n // 4:    # in place, but for a few rows
                table = old.copy()
                table[n:] = 0
            else:
                rows_of = {id(v): i for i, v in enumerate(old_views)}
                src = np.fromiter((rows_of.get(id(v), -1) for v in views), np.int64, n)
                table = np.zeros(shape, np.int32)
                hit = np.flatnonzero(src >= 0)
                table[hit] = old[src[hit]]
                moved = np.flatnonzero(src < 0)
            if len(moved):
                part = np.zeros((len(moved), shape[1]), np.int32)
                _fill(part, [views[i] for i in moved])
                table[moved] = part
        self._last[shape] = (views, table)
        return table


def prepare(output: SchedulerOutput, bucket: Bucket, page_size: int,
            tables: PageTables | None = None) -> StepArrays:
    """The step's arrays for `bucket`; tables: the engine's PageTables, which builds the page
    table from the last step's (None: from the rows' pages alone)."""
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

    if tables is None:
        page_table = np.zeros((B, W), np.int32)
        _fill(page_table[:n_rows], page_ids)
    else:
        page_table = tables.build(page_ids, (B, W))

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
