"""Block sizes for the paged attention kernels, kept as data per shape class.

Measured on one H200 (bench/kernels.py --tune); a shape class is (KV bytes per element, head
dim). `num_splits` is not in the table: it follows from the grid size by a rule (below), since
the work per program, not the shape, decides how well the 132 SMs are filled.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    block_tokens: int  # KV tokens per loop step (a multiple of the page size)
    num_splits: int    # split-K partitions of the context, combined afterwards
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class RaggedBlocks:
    block_q: int       # query tokens of one sequence per program
    block_tokens: int  # KV tokens per loop step
    num_warps: int
    num_stages: int


# (kv itemsize, head dim) -> (block_tokens, num_warps, num_stages)
DECODE_TABLE = {
    (1, 64): (128, 4, 3),
    (1, 128): (128, 4, 3),
    (2, 64): (128, 4, 3),
    (2, 128): (64, 4, 3),
    (4, 64): (32, 4, 2),
    (4, 128): (32, 4, 2),
}
RAGGED_TABLE = {  # (kv itemsize, head dim) -> (block_q, block_tokens, num_warps, num_stages)
    (1, 64): (16, 64, 4, 2),
    (1, 128): (16, 64, 4, 2),
    (2, 64): (16, 64, 4, 2),
    (2, 128): (16, 64, 4, 2),
    (4, 64): (16, 32, 4, 1),
    (4, 128): (16, 32, 4, 1),
}

# Split the context until the grid holds about this many programs (2 per SM of 132), but
# never below MIN_SPLIT_TOKENS per split: the combine must stay cheap.
TARGET_PROGRAMS = 264
MIN_SPLIT_TOKENS = 512


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def decode_blocks(batch: int, kv_heads: int, max_tokens: int, page_size: int,
                  itemsize: int, head_dim: int) -> DecodeBlocks:
    tokens, warps, stages = DECODE_TABLE.get((itemsize, head_dim), (32, 4, 2))
    tokens = max(tokens, page_size, 16)
    programs = batch * kv_heads
    want = -(-TARGET_PROGRAMS // programs)
    most = max(max_tokens // MIN_SPLIT_TOKENS, 1)
    return DecodeBlocks(tokens, _pow2_floor(min(want, most)), warps, stages)


def ragged_blocks(itemsize: int, head_dim: int, page_size: int) -> RaggedBlocks:
    bq, tokens, warps, stages = RAGGED_TABLE.get((itemsize, head_dim), (16, 32, 4, 1))
    return RaggedBlocks(bq, max(tokens, page_size, 16), warps, stages)
