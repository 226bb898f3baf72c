"""The fixed shapes the device step is compiled for, and the choice of one per step.

A jitted step recompiles for every new input shape, so the engine pads each step to one of a
small set of buckets (num_tokens T, num_seqs B, pages_per_seq) compiled ahead of time
(`all_buckets`). Two families:

  decode buckets   T == B (every row has one token), geometric in B up to max_num_seqs.
                   Decode is the steady state and bound by reading the weights once per
                   step, so a padded row costs little; the static `decode_only` flag lets
                   the runner use the decode attention kernel.
  mixed buckets    prefill chunks and decode rows together, geometric in T from `min_tokens`
                   up to max_num_batched_tokens, with B = min(T, max_num_seqs). B is cheap to
                   over-provision here: it only sizes the metadata and the B logits rows,
                   noise next to a T-token forward pass.
  verify buckets   speculative decoding (speculative.py): B rows of up to k + 1 tokens (the
                   last token and k proposed ones), T = B * (k + 1), and a sampled token at
                   EVERY token (`verify`: T logits rows), geometric in B up to the engine's
                   speculative_rows. Chosen with `choose_verify`.

Geometric steps (factor `growth`, the limits themselves always included) keep the bucket count
logarithmic and the padding bounded: at most a fraction (1 - 1/growth) of a bucket is padding.
A step's kind is known from its sizes alone: num_tokens == num_seqs means every row has exactly
one token (each row has at least one), so such a step takes a decode bucket.

pages_per_seq (page-table width) takes one value by default, the engine's maximum: it only
sizes the page table, since attention stops at seq_lens. Pass more levels to trade compile
time for smaller page tables (the plain-jnp reference attention gathers the full width).

`choose` also keeps the padding-waste account: real vs padded tokens over all steps.
`fitted_tokens` is the scheduler's side of it: how far to cut a step that would be padded up
to the next mixed size.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence


# A step's fixed cost (reading the weights, launching, the host) in token-times of its
# per-token compute: ~200-400 for an 8B model on Hopper in bf16 and FP8 alike. It sets where
# fitted_tokens cuts: a 300-token step is cut to 256, a 400-token one padded to 512.
SHAPE_OVERHEAD_TOKENS = 256


def fitted_tokens(total: int, num_rows: int, last: int, sizes: Sequence[int]) -> int:
    """How many of its `last` tokens a step's last row keeps, for a step of `total` tokens
    in `num_rows` rows and the mixed sizes `sizes` (ascending): all of them, or fewer so the
    step fills the size below instead of being padded up to the one above, when that
    computes more real tokens per unit of step time. A step of T tokens in a size of S costs
    about F + S token-times (F: SHAPE_OVERHEAD_TOKENS), so cutting to `lo` wins when
    lo / (F + lo) >= T / (F + hi). A decode step (one token a row), one that fills its size,
    and a cut that would leave the row no token keep everything."""
    k = bisect.bisect_left(sizes, total)
    if total == num_rows or k in (0, len(sizes)) or sizes[k] == total:
        return last
    lo, hi, f = sizes[k - 1], sizes[k], SHAPE_OVERHEAD_TOKENS
    keep = last - (total - lo)
    return keep if keep >= 1 and lo * (f + hi) >= total * (f + lo) else last


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int      # T
    num_seqs: int        # B
    pages_per_seq: int
    decode_only: bool    # T == B and every real row has one token
    verify: bool = False  # a token is sampled at every one of the T tokens (speculative step)

    @property
    def num_samples(self) -> int:
        """Logits rows (sampled tokens) of a step of this shape: T for verify, else B."""
        return self.num_tokens if self.verify else self.num_seqs


def geometric(lo: int, hi: int, growth: float = 2.0) -> list[int]:
    """lo, lo*growth, ... capped at hi, always ending with hi (integers, strictly rising)."""
    if not 1 <= lo <= hi or growth <= 1:
        raise ValueError(f"need 1 <= lo <= hi and growth > 1, got {lo}, {hi}, {growth}")
    values, x = [], float(lo)
    while round(x) < hi:
        if not values or round(x) > values[-1]:
            values.append(round(x))
        x *= growth
    return values + [hi]


class Buckets:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_pages_per_seq: int,
                 *, min_tokens: int = 16, growth: float = 2.0,
                 pages_per_seq_levels: Sequence[int] | None = None,
                 num_speculative_tokens: int = 0, speculative_rows: int = 0):
        # A step never has more rows than tokens, whatever max_num_seqs says.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_sizes = geometric(1, self.max_num_seqs, growth)
        self.mixed_sizes = geometric(min(min_tokens, max_num_batched_tokens),
                                     max_num_batched_tokens, growth)
        levels = sorted(set(pages_per_seq_levels or ())) or [max_pages_per_seq]
        if levels[-1] != max_pages_per_seq or levels[0] < 1:
            raise ValueError(f"pages_per_seq_levels must lie in [1, {max_pages_per_seq}] and "
                             f"include it, got {pages_per_seq_levels}")
        self.page_levels = levels
        self.verify_width = num_speculative_tokens + 1
        self.verify_sizes = (geometric(1, min(speculative_rows, self.max_num_seqs), growth)
                             if num_speculative_tokens and speculative_rows else [])
        self.real_tokens = 0
        self.padded_tokens = 0

    @classmethod
    def from_config(cls, config, **kw) -> "Buckets":
        """From an EngineConfig (anything with max_num_seqs, max_num_batched_tokens,
        pages_per_seq; num_speculative_tokens and speculative_rows where it has them)."""
        return cls(config.max_num_seqs, config.max_num_batched_tokens, config.pages_per_seq,
                   num_speculative_tokens=getattr(config, "num_speculative_tokens", 0),
                   speculative_rows=getattr(config, "speculative_rows", 0), **kw)

    def all_buckets(self) -> list[Bucket]:
        """Every shape `choose` can return, for ahead-of-time compilation."""
        out = [Bucket(b, b, p, True) for b in self.decode_sizes for p in self.page_levels]
        out += [Bucket(t, min(t, self.max_num_seqs), p, False)
                for t in self.mixed_sizes for p in self.page_levels]
        out += [Bucket(b * self.verify_width, b, p, False, True)
                for b in self.verify_sizes for p in self.page_levels]
        return out

    def choose(self, num_tokens: int, num_seqs: int, max_pages: int) -> Bucket:
        """The smallest bucket holding a step of num_tokens tokens in num_seqs rows whose
        longest page list has max_pages pages; records the padding."""
        if not 1 <= num_seqs <= min(num_tokens, self.max_num_seqs):
            raise ValueError(f"a step needs 1 <= num_seqs <= min(num_tokens, max_num_seqs="
                             f"{self.max_num_seqs}), got num_seqs={num_seqs}, "
                             f"num_tokens={num_tokens}")
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"num_tokens {num_tokens} exceeds max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
        pages = self._pages(max_pages)
        if num_tokens == num_seqs:
            b = self.decode_sizes[bisect.bisect_left(self.decode_sizes, num_seqs)]
            return self._record(num_tokens, Bucket(b, b, pages, True))
        t = self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, num_tokens)]
        return self._record(num_tokens, Bucket(t, min(t, self.max_num_seqs), pages, False))

    def choose_verify(self, num_tokens: int, num_seqs: int, max_pages: int) -> Bucket:
        """The smallest verify bucket holding a speculative step of num_seqs rows (each of at
        most k + 1 tokens, num_tokens in all); records the padding."""
        if not self.verify_sizes or not 1 <= num_seqs <= self.verify_sizes[-1]:
            raise ValueError(f"a verify step needs 1 <= num_seqs <= "
                             f"{(self.verify_sizes or [0])[-1]} (speculative rows), got "
                             f"{num_seqs}")
        if not num_seqs <= num_tokens <= num_seqs * self.verify_width:
            raise ValueError(f"a verify step of {num_seqs} rows holds {num_seqs} to "
                             f"{num_seqs * self.verify_width} tokens, got {num_tokens}")
        b = self.verify_sizes[bisect.bisect_left(self.verify_sizes, num_seqs)]
        return self._record(num_tokens, Bucket(b * self.verify_width, b,
                                               self._pages(max_pages), False, True))

    def _pages(self, max_pages: int) -> int:
        """The smallest page-table width holding `max_pages` pages."""
        if max_pages > self.page_levels[-1]:
            raise ValueError(f"max_pages {max_pages} exceeds pages_per_seq "
                             f"{self.page_levels[-1]}")
        return self.page_levels[bisect.bisect_left(self.page_levels, max_pages)]

    def _record(self, num_tokens: int, bucket: Bucket) -> Bucket:
        """Count a step of `num_tokens` real tokens padded to `bucket`; returns the bucket."""
        self.real_tokens += num_tokens
        self.padded_tokens += bucket.num_tokens
        return bucket

    @property
    def padding_fraction(self) -> float:
        """Share of the tokens computed so far that were padding."""
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
