"""Block sizes for the paged attention kernels and the FP8 GEMV, kept as data, and the rules
that pick them by grid size.

Measured on one H200 with `jaxinfer bench kernels`; a shape class is (KV bytes per element,
head dim). `num_splits` is not in the tables: it follows from the grid size by a rule
(split_count), since the work per program, not the shape, decides how well the 132 SMs are
filled. `fp8_compute` is the dtype FP8 K/V are widened to for the tensor-core dots
(attention_block.py): "f16pairs" reads e4m3 bytes as u16 pairs so their shared-memory tiles
load like bf16 ones. `prefetch_table` reads the next block's page ids one loop step ahead so
Triton's pipeliner can double-buffer K/V. The measurements behind each entry and rule are in
docs/performance.md.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    block_tokens: int  # KV tokens per loop step (a multiple of the page size)
    num_splits: int    # split-K partitions of the context, combined afterwards
    num_warps: int
    num_stages: int
    fp8_compute: str = "bfloat16"  # FP8 K/V widened to: "bfloat16" | "float16" | "f16pairs"
    # Read the next block's page-table entries one loop step ahead (carried), so the
    # K/V copies' addresses do not wait on a page-table load and Triton's pipeliner can
    # double-buffer K/V (without it, it keeps one K/V buffer whatever num_stages is).
    prefetch_table: bool = False


@dataclasses.dataclass(frozen=True)
class RaggedBlocks:
    block_q: int       # query tokens of one sequence per program
    block_tokens: int  # KV tokens per loop step
    num_warps: int
    num_stages: int
    fp8_compute: str = "bfloat16"
    prefetch_table: bool = False   # as DecodeBlocks'
    # Each row's q blocks listed last first: the causally heaviest programs (most KV blocks)
    # start first and the grid's tail holds light ones instead of the longest.
    heavy_first: bool = False
    # split-K over each q block's KV blocks, merged by a combine kernel (not in the table:
    # ragged_blocks sets it by a rule from the grid and the context, like decode_blocks)
    num_splits: int = 1


FP8_COMPUTE = ("bfloat16", "float16", "f16pairs")


# The measured tables (tuning_h200.json): (kv itemsize, head dim) -> the fields below, in order
_TABLES = json.loads((Path(__file__).resolve().parent / "tuning_h200.json").read_text())
DECODE_FIELDS = ("block_tokens", "num_warps", "num_stages", "fp8_compute", "prefetch_table")
RAGGED_FIELDS = ("block_q", "block_tokens", "num_warps", "num_stages", "fp8_compute",
                 "prefetch_table", "heavy_first")


def _table(name: str, fields: tuple[str, ...]) -> dict[tuple[int, int], tuple]:
    defaults = {"prefetch_table": False, "heavy_first": False}
    return {(r["kv_bytes"], r["head_dim"]): tuple(r.get(f, defaults.get(f)) for f in fields)
            for r in _TABLES[name]}


DECODE_TABLE = _table("decode", DECODE_FIELDS)
RAGGED_TABLE = _table("ragged", RAGGED_FIELDS)

# Split the context until the grid holds about this many programs (2 per SM of 132), but
# never below MIN_SPLIT_TOKENS per split: the combine must stay cheap.
TARGET_PROGRAMS = 264
MIN_SPLIT_TOKENS = 64


# Unsplit FP8 decode grids of ONE_WAVE_PROGRAMS programs take these blocks instead: half the
# warps and tokens of the table's, so 4 programs fit per SM and up to 528 run in one wave.
ONE_WAVE_TABLE = _table("decode_one_wave", DECODE_FIELDS)
ONE_WAVE_PROGRAMS = (TARGET_PROGRAMS + 1, 528)

# Unsplit decode grids of this many programs (one per row and kv head) run the rows longest
# first, so the last wave holds short rows instead of one long row alone. The model asks for
# the window (longest_first=None); the kernel benchmark keeps the grid order.
LONGEST_FIRST_PROGRAMS = (TARGET_PROGRAMS + 1, 2048)

# Grids of at least this many programs read a sequence's last, partly filled block with
# masked loads (attention_block.read_rows); smaller grids ran faster unmasked.
MASKED_LOADS_MIN_PROGRAMS = 2048


def grid_rules(total: int, rows: int | None, kv_heads: int, splits: int,
               longest_first: bool | None, masked_loads: bool | None) -> tuple[bool, bool]:
    """paged_attention.paged_attention_blocks' two rules resolved (None: by
    LONGEST_FIRST_PROGRAMS and MASKED_LOADS_MIN_PROGRAMS); longest first only on unsplit
    grids."""
    if longest_first is None:
        lo, hi = LONGEST_FIRST_PROGRAMS
        longest_first = 0 < lo <= (rows or total) * kv_heads <= hi
    if masked_loads is None:
        programs = grid_rows(total, rows, splits) * kv_heads * splits
        masked_loads = 0 < MASKED_LOADS_MIN_PROGRAMS <= programs
    return bool(longest_first and splits == 1), bool(masked_loads)


def grid_rows(total: int, rows: int | None, splits: int) -> int:
    """The rows the decode grid covers: split, the real rows only (the combine pads);
    else every row (padding rows have seq_len 0 and write their zeros themselves)."""
    return total if rows is None or splits == 1 else rows


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def split_count(programs: int, max_tokens: int, min_split_tokens: int) -> int:
    """Both kernels' split rule: the power of two that brings `programs` up to about
    TARGET_PROGRAMS, but no more splits than leave min_split_tokens of max_tokens each."""
    want = -(-TARGET_PROGRAMS // max(programs, 1))
    return _pow2_floor(min(want, max(max_tokens // min_split_tokens, 1)))


def decode_blocks(batch: int, kv_heads: int, max_tokens: int, page_size: int,
                  itemsize: int, head_dim: int) -> DecodeBlocks:
    splits = split_count(batch * kv_heads, max_tokens, MIN_SPLIT_TOKENS)
    lo, hi = ONE_WAVE_PROGRAMS
    entry = DECODE_TABLE.get((itemsize, head_dim), (32, 4, 2, "bfloat16"))
    if splits == 1 and lo <= batch * kv_heads <= hi:
        entry = ONE_WAVE_TABLE.get((itemsize, head_dim), entry)
    tokens, warps, stages, fp8, *prefetch = entry
    return DecodeBlocks(max(tokens, page_size, 16), splits, warps, stages, fp8, *prefetch)


# The ragged kernel's split rule: split each q block's KV blocks until the grid holds about
# TARGET_PROGRAMS programs, counting every q block the bucket's tokens could form, but keep
# >= RAGGED_MIN_SPLIT_TOKENS of the bucket's context per split.
RAGGED_MIN_SPLIT_TOKENS = 256


def ragged_splits(num_tokens: int, block_q: int, kv_heads: int, max_tokens: int) -> int:
    return split_count(-(-num_tokens // block_q) * kv_heads, max_tokens,
                       RAGGED_MIN_SPLIT_TOKENS)


def ragged_blocks(itemsize: int, head_dim: int, page_size: int, num_tokens: int = 0,
                  kv_heads: int = 0, max_tokens: int = 0) -> RaggedBlocks:
    """The table's blocks for a shape class; given the bucket (tokens, kv heads, context
    capacity in tokens), with the split rule's num_splits (else 1)."""
    bq, tokens, warps, stages, fp8, *flags = RAGGED_TABLE.get(
        (itemsize, head_dim), (16, 32, 4, 1, "bfloat16"))
    blocks = RaggedBlocks(bq, max(tokens, page_size, 16), warps, stages, fp8, *flags)
    if num_tokens and kv_heads and max_tokens:
        blocks = dataclasses.replace(blocks, num_splits=ragged_splits(
            num_tokens, bq, kv_heads, max_tokens))
    return blocks


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    bn: int                 # output channels per program
    bk: int                 # K elements per loop step
    num_warps: int
    reduce_each_step: bool  # sum each step's products to [BN] (vs a [BN, BK] accumulator)
    prefetch: int           # weight tiles loaded ahead


# The FP8 GEMV's tiles (fp8_matmul.py's Pallas kernel at M = 1), the best measured on the
# Llama-3-8B projections. No tiling beat XLA's route at M = 1, so fp8_linear sends M = 1 to XLA.
FP8_GEMV = GemvTiles(**_TABLES["fp8_gemv"])
