"""What the scheduler decides for one step: each request's share (ScheduledRow) and the step
as a whole (SchedulerOutput). Host types, no jax; scheduler.py makes them, batch.py turns them
into arrays."""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import NamedTuple

import numpy as np


class ScheduledRow(NamedTuple):
    """One request's share of a step (a named tuple: hundreds are made every step)."""

    request_id: str
    token_ids: tuple[int, ...]   # fed this step
    start_pos: int               # position of token_ids[0] in the request
    page_ids: np.ndarray         # [pages] i32, read-only: all pages of the request, covering
                                 # start_pos + len(token_ids)
    samples: bool                # this chunk ends the request's tokens: sample the next one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length including this step's tokens."""
        return self.start_pos + len(self.token_ids)


# ScheduledRow.page_ids by position (an itemgetter: faster than the attribute over hundreds
# of rows a step), the position found by name so a reordering of the fields cannot break it
_pages_of = operator.itemgetter(ScheduledRow._fields.index("page_ids"))


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    rows: tuple[ScheduledRow, ...]   # running requests first (oldest first), then admitted ones
    preempted_ids: tuple[str, ...] = ()
    # A speculative step: every row is a decode row whose token_ids are its last token and
    # the proposed ones (none for some rows), and a token is sampled at each of them.
    verify: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @functools.cached_property
    def max_pages(self) -> int:   # read by the bucket's choice and by batch.prepare
        return max(map(len, map(_pages_of, self.rows)), default=0)

    @property
    def is_empty(self) -> bool:
        return not self.rows
