"""Block sizes for the paged attention kernels and the FP8 GEMV, kept as data.

Measured on one H200 (bench/kernels.py --tune); a shape class is (KV bytes per element, head
dim). `num_splits` is not in the table: it follows from the grid size by a rule (below), since
the work per program, not the shape, decides how well the 132 SMs are filled.

`fp8_compute` is the dtype FP8 K/V are widened to for the tensor-core dots (numerics in
pallas_kernels/attention_block.py's docstring); it only matters for FP8 KV. Decode picked
float16 before f16pairs (below), measured on the H200
(`bench/results/history/paged_attention_8de99ec.json`, rows `jaxinfer` vs
`jaxinfer_bf16widen`, same blocks): B=64 S=2048 151.7 vs 178.2 us, B=64 S=8192 533.6 vs 801.8,
B=256 S=2048 572.5 vs 904.9. FP8 decode used 2 pipeline stages before page-table prefetch (below;
the --tune sweep of 22f427a:
B=64 S=2048 126.0 us with 2 stages, 152.2 with 3, 132.1 with 4; B=256 S=2048 464.9 / 480.5 /
496.8); (1, 64) was not re-timed and keeps 3. Splitting the context did not help at B >= 64
(1, 2 and 4 splits timed: 1 was best or within noise), so the program target below stays; its
token floor moved (see there). Under Nsight Compute (B=256 S=2048) the FP8 kernel uses 255
registers per thread, so only 2 blocks (8 warps) fit per SM: it is latency-bound at 58% of
DRAM peak, where the bf16 kernel (128 registers, 4 blocks per SM) reaches 93%. Fewer live
registers per program looked like the next lever; two ways of getting them were measured and
dropped (bench/README.md, fifth session): K/V widened in head-dim column blocks (255 -> 168
registers by ptxas, 3 blocks per SM, but B=64 S=2048 136.6 -> 188.3 us) and K transposed
before widening (within noise). Over a whole mixed step's rows f16 widening was 4-12% faster
for the ragged kernel (bench/results/history/mixed_attention_bffea72.json, `ragged_all_*`);
its prefill-only case is timed at the end of this docstring.

"f16pairs" (pallas_kernels/attention_block.py) reads FP8 K/V as u16 pairs of
e4m3 bytes, so their shared-memory tiles load with ldmatrix like bf16 ones, and splits each
pair into the even and odd head dims in registers (ptxas: 241 -> 168 registers, 253 -> 53
scalar shared loads). Sixth session's sweep (attn_tune.txt, one process, 4 warps, 2 stages,
128 tokens): B=64 S=2048 135.1 -> 120.6 us, B=256 S=2048 481.3 -> 345.4 (3.22 TB/s), B=1
S=32768 (32 splits) 52.2 -> 43.9, B=8 S=8192 80.4 -> 73.1; 3 stages, 8 warps and 256-token
blocks were slower for pairs at B=64/256 (without prefetch). It is the (1, 128) decode
choice; (1, 64) was not timed with it and keeps "float16". The ragged kernel takes it too:
the host-clock mixed bench had it slower on a prefill row (480-598 vs ~410 us per layer;
history/mixed_attention_e098ea5.json), the device-time probe at the end of this docstring
faster.
Splitting the FP8 decode context 2, 3, 5 or 6 ways at B=64 S=2048 (512 programs for ~396
block slots) stayed within noise (attn_tune.txt).

Page-table prefetch (prefetch_table; attention_block.paged_loop). With the page ids read inside
the loop step, Triton's pipeliner keeps one K/V buffer in shared memory at any num_stages (the
ids' load takes the earlier stage), so a program's next copy is issued only after its current
block's math. Carrying the next block's ids makes the K/V loads pipelinable: at 3 stages the
ttgir holds 2x K/V tiles (local Triton 3.5 compile of the kernel's IR, not the H200's bundled
Triton; FP8 pairs at 128 tokens: 75 -> 109 KB shared, so 3 -> 2 blocks per SM by shared
memory; ptxas: 168 registers either way). Seventh session (attn_tune.txt, two passes, each
pair back to back): FP8 pairs, 128 tokens, 4 warps, 3 stages: B=64 S=2048 96.6/105.3 us with
prefetch vs 140.1/140.5 without (and 138.8/129.9 for the old 2-stage entry); B=256 S=2048
344.1/373.7 vs 359.6/381.6; 64-token and 4-stage variants were slower with it. That is the
(1, 128) entry now; the whole grid (bench/results/paged_attention.json) has B=64 S=2048 at
102 us and B=256 S=2048 at 326. bf16
gained 3-5% at B=64 S=2048 in the sweep but lost at 256 rows (88 KB shared, 2 blocks per SM
instead of 4): one mixed step's 255 decode rows 556/573 us with it vs 534/444 without
(mixed_attention.json, rows split_decode@...), so bf16 keeps it off. The ragged kernel's
prefill row under prefetch variants stayed within the bench's noise (same file).

Ragged, head dim 128 (twenty-first session): bench/probes/ragged_prefill.py times the kernel
on prefill chunks alone by device time, variants interleaved over 4 rounds (spread ~1%,
where the mixed bench's host clock read one entry at 263 and 344 us). One layer, FP8 KV,
device us for a 1793-token first chunk / a 560 + 1000-token chunk like the throughput run's:
the old entry (16, 64, 4, 2, bfloat16) 209.4 / 137.4; heavy_first alone 195.9 / 132.3; with
f16pairs 173.7 / 122.7 (-17% / -11%); float16 174.6 / 121.6; (32, 64, 4, 2, bfloat16)
171.2 / 125.9; 16 q tokens and 128 KV tokens with f16pairs 165.2 / 126.0. On another
machine (the old entry 207.3 / 136.5 there) 8 warps were slower: (32, 64, 8, 2, bfloat16)
214.8 / 142.7, 256-row tiles (64, 64, 8, 2) 213.3 / 142.6. bf16 KV: the old entry 123.2 / 90.6; with
page-table prefetch, 3 stages and heavy_first 113.2 / 85.3 (-8% / -6%). Head dim 64 was not
timed and keeps its entries (bench/results/ragged_prefill_*.json).
"""
from __future__ import annotations

import dataclasses
import os

from jaxinfer.errors import ConfigError


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


# (kv itemsize, head dim) -> (block_tokens, num_warps, num_stages, fp8_compute[, prefetch_table])
DECODE_TABLE = {
    (1, 64): (128, 4, 3, "float16"),
    (1, 128): (128, 4, 3, "f16pairs", True),
    (2, 64): (128, 4, 3, "bfloat16"),
    (2, 128): (64, 4, 3, "bfloat16"),
    (4, 64): (32, 4, 2, "bfloat16"),
    (4, 128): (32, 4, 2, "bfloat16"),
}
# (kv itemsize, head dim) -> (block_q, block_tokens, num_warps, num_stages, fp8_compute[,
#  prefetch_table[, heavy_first]])
RAGGED_TABLE = {
    (1, 64): (16, 64, 4, 2, "bfloat16"),
    (1, 128): (16, 64, 4, 2, "f16pairs", False, True),
    (2, 64): (16, 64, 4, 2, "bfloat16"),
    (2, 128): (16, 64, 4, 3, "bfloat16", True, True),
    (4, 64): (16, 32, 4, 1, "bfloat16"),
    (4, 128): (16, 32, 4, 1, "bfloat16"),
}

# Split the context until the grid holds about this many programs (2 per SM of 132), but
# never below MIN_SPLIT_TOKENS per split: the combine must stay cheap. The floor was 512;
# at 64, B=1 C=512 (8 programs -> 64) the Llama-3-8B decode step ran 5.24 -> 5.02 ms (bf16)
# and 3.37 -> 3.19 ms (FP8 weights) back to back on the H200 (bench/results/splits.json),
# while the synced step (host round trip each step) moved 6.26 -> 6.35 and 4.35 -> 4.56 ms.
# Serving overlaps the host (async scheduling), so the device time is what it sees.
# Grids already holding >= 264 programs (B >= 33 at 8 kv heads) are unaffected. The
# environment variable JAXINFER_MIN_SPLIT_TOKENS overrides the floor for an experiment (read
# at import, so a process that compares values runs once per value).
TARGET_PROGRAMS = 264
MIN_SPLIT_TOKENS = int(os.environ.get("JAXINFER_MIN_SPLIT_TOKENS", "64"))


# Unsplit FP8 decode grids of ONE_WAVE_PROGRAMS programs take these blocks instead: half the
# warps and tokens of the table's, so 4 programs fit per SM (shared memory: 64 tokens x 2 x
# 128 B x 3 stages = 48 KB) and up to 528 run in one wave, where the table's entry runs 2 per
# SM (264) and a grid of 265-528 programs in two. H200, device us, static K/V scales,
# `bench.kernels --tune` two passes, page-table prefetch on (bench/README.md, twenty-sixth
# session): B=64 S=2048 (512 programs) 70.0 / 70.2 vs 72.0 / 72.0, B=48 57.8 / 57.9 vs
# 65.1 / 65.2, B=40 55.6 / 55.6 vs 61.1 / 63.2, B=66 71.9 / 72.0 vs 74.1 / 74.1, B=64 S=1024
# 38.2 / 38.5 vs 42.2 / 42.2, B=64 S=4096 130.0 / 131.3 vs 131.9 / 131.7; past one wave,
# B=80 (640 programs) 112.7 / 114.7 vs 97.2 / 97.7 and B=256 274.6 vs 261.3. Per-token
# scales, B=64 S=2048: 73.3 / 73.0 vs 76.9 / 76.6. Grids of <= 264 programs already run in
# one wave and keep the table's entry (not timed with these blocks). Head dim 64 not timed.
# JAXINFER_ONE_WAVE="LO,HI" overrides the window at import (A/B runs; "0,0" is off).
ONE_WAVE_TABLE = {
    (1, 128): (64, 2, 3, "f16pairs", True),
}


def env_window(name: str, default: str) -> tuple[int, int]:
    """A program-count window (LO, HI) from environment variable `name` ("LO,HI"), else
    from `default`: the A/B overrides of this module's and paged_attention's windows."""
    text = os.environ.get(name, default)
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{name}={text!r}: want two whole numbers 'LO,HI' (programs; "
                          "'0,0' turns it off)") from None
    return lo, hi


ONE_WAVE_PROGRAMS = env_window("JAXINFER_ONE_WAVE", f"{TARGET_PROGRAMS + 1},528")


# The decode grid's order and loads by its size (paged_attention.paged_attention_blocks).
# Unsplit grids of LONGEST_FIRST_PROGRAMS[0]..[1] programs (one per row and kv head) run the
# rows longest first. Programs start in grid order as SM slots free up, so with rows of
# unequal lengths a long row late in the grid runs alone at the end; longest first, the last
# wave holds the short rows. H200, device time, rows 0.5-1.5x the mean length against equal
# lengths at the same mean (bench/README.md, seventeenth session): FP8 KV B=64 S~2048 (512
# programs, ~2 waves of 2 per SM) 96.7 -> 83.8 us (equal 77.4), B=256 S~1536 245.9 -> 243.4;
# bf16 KV B=256 397.3 -> 381.8, B=64 140.1 -> 142.0 (one wave of 4 per SM). At 4096 programs
# (B=512) FP8 465.4 -> 469.2 and bf16 769.1 -> 751.1: outside the window. The order is an
# argsort of the lengths (the probe's equal-length calls, sort included, took ~3.5 us more;
# the model's layers share one sort per step, XLA's CSE: tests/test_paged_attention.py).
# The model asks for the window (longest_first=None); the kernel benchmark's calls keep the
# grid order (False, the default).
# JAXINFER_LONGEST_FIRST="LO,HI" overrides the window at import (A/B runs; "0,0" is off).
LONGEST_FIRST_PROGRAMS = env_window("JAXINFER_LONGEST_FIRST", f"{TARGET_PROGRAMS + 1},2048")

# Grids of at least this many programs read a sequence's last, partly filled block with
# masked loads (attention_block.read_rows): the tokens past its length are not read. H200,
# device us per call, bench/probes/longest_first.py in two calls (bench/README.md, seventeenth
# session), masked vs read and zeroed (a variant that zeroed K too; the unmasked kernel kept
# here, from an earlier call, in parentheses): FP8 KV B=256 S~1536 with lengths 0.5-1.5x the
# mean 216.3 / 216.3 vs 245.1 (245.9), B=512 404.4 / 407.4 vs 467.2 (465.4); at equal
# lengths, where no block is partly filled, 214.0 / 215.0 vs 220.9 (225.3) and 397.7 / 397.4
# vs 425.6 (433.5): the kernel compiles differently. bf16 KV, spread: B=256 383.5 vs 394.8
# (397.3), B=512 738.4 vs 763.9 (769.1). At B=64 (512 programs) FP8 ran slower masked, 95.8
# vs 76.6 (77.4) us at equal lengths, so smaller grids keep the unmasked kernel (its Triton
# IR is the one from before this switch). JAXINFER_MASKED_LOADS overrides the threshold at
# import (0 is off).
MASKED_LOADS_MIN_PROGRAMS = int(os.environ.get("JAXINFER_MASKED_LOADS", "2048"))


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


def parse_ragged(text: str) -> tuple:
    """'block_q,block_tokens,warps,stages,fp8_compute[,prefetch[,heavy_first]]' -> a
    RAGGED_TABLE value (prefetch, heavy_first: 0 or 1, default 0)."""
    parts = text.split(",")
    if (len(parts) not in (5, 6, 7) or parts[4] not in FP8_COMPUTE
            or any(x not in ("0", "1") for x in parts[5:])):
        raise ValueError(f"ragged blocks {text!r}: want block_q,block_tokens,warps,stages,"
                         f"fp8_compute[,prefetch[,heavy_first]] with fp8_compute one of "
                         f"{FP8_COMPUTE} and prefetch, heavy_first 0 or 1")
    return (*map(int, parts[:4]), parts[4], *([x == "1" for x in parts[5:]] or [False]))


# An experiment's override of RAGGED_TABLE for every class (bench result files record it under
# "env"); read at import, like JAXINFER_MIN_SPLIT_TOKENS.
RAGGED_OVERRIDE = (parse_ragged(os.environ["JAXINFER_RAGGED_BLOCKS"])
                   if os.environ.get("JAXINFER_RAGGED_BLOCKS") else None)


# The ragged kernel's split rule: split each q block's KV blocks until the grid holds about
# TARGET_PROGRAMS programs, counting every q block the bucket's tokens could form (W), but
# keep >= RAGGED_MIN_SPLIT_TOKENS of the bucket's context per split. A chunk of T tokens has
# cdiv(T, block_q) * K programs: at the throughput run's 2,048 tokens 1,024 (no split); at
# the engine's default 256-token chunks 128, on under one wave, however long the context.
# H200, bench/probes/ragged_prefill.py, device us, 1 / 2 / 4 / 8 splits (twenty-first
# session, bench/results/ragged_prefill_splits.json): the last 256-token chunk of an
# 8,000-token prompt, FP8 KV 204.2 / 165.7 / 175.0 / 190.0, bf16 117.1 / 100.2 / 104.8 /
# 115.1 (the rule: 2); 50 new tokens after a 4,000-token cached prefix, FP8 108.2 / 63.0 /
# 37.4 / 32.9, bf16 61.5 / 35.8 / 23.2 / 22.2 (the rule with a 1,024-token floor gave 2, so
# the floor is 256 now: 8). JAXINFER_RAGGED_MIN_SPLIT_TOKENS overrides the floor at import
# (A/B runs; a value above any context turns splitting off).
RAGGED_MIN_SPLIT_TOKENS = int(os.environ.get("JAXINFER_RAGGED_MIN_SPLIT_TOKENS", "256"))


def ragged_splits(num_tokens: int, block_q: int, kv_heads: int, max_tokens: int) -> int:
    return split_count(-(-num_tokens // block_q) * kv_heads, max_tokens,
                       RAGGED_MIN_SPLIT_TOKENS)


def ragged_blocks(itemsize: int, head_dim: int, page_size: int, num_tokens: int = 0,
                  kv_heads: int = 0, max_tokens: int = 0) -> RaggedBlocks:
    """The table's blocks for a shape class; given the bucket (tokens, kv heads, context
    capacity in tokens), with the split rule's num_splits (else 1)."""
    bq, tokens, warps, stages, fp8, *flags = RAGGED_OVERRIDE or RAGGED_TABLE.get(
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


# The FP8 GEMV (pallas_kernels/fp8_matmul.py, M = 1), from `bench/fp8_matmul.py --tune-only`
# on one H200 (first run: bench/results/history/fp8_tune_fcca621.json), us per call on the
# four Llama-3-8B projections (K x N: 4096x6144, 4096x4096, 4096x28672, 14336x4096). The
# second run (bench/results/fp8_tune.json) matched the chosen tiling within 1-2% on three
# shapes; the small ones are noisy (4096x4096: 9.4 -> 13.3 us; bn 4 on 4096x6144: 13.4 -> 18.1):
#   bn 8,  bk 512,  acc [BN, BK], prefetch 1 (the previous default): 16.5 13.2 49.4 30.8
#   bn 8,  bk 1024, reduced per step, prefetch 1 (chosen):           16.9  9.4 46.2 26.3
#   bn 4,  bk 2048, reduced per step:                                13.4 10.8 49.1 25.6
# Nineteen variants over the two runs, tensor-core ones
# (x padded to 16 rows) included: none above 2.55 TB/s of fp8 bytes, so fp8_linear sends
# M = 1 to XLA (pallas_kernels/fp8_matmul.py's routes). Split-K follows from the grid size.
FP8_GEMV = GemvTiles(bn=8, bk=1024, num_warps=4, reduce_each_step=True, prefetch=1)
