"""Speculative decoding, the host's side: proposers and the acceptance count.

A speculative step (EngineConfig.num_speculative_tokens = k > 0) feeds each decode row its
last token plus up to k tokens a proposer guessed, samples a token at EVERY one of them in one
forward pass (a verify bucket, buckets.py), and keeps the sampled tokens up to and including
the first that differs from the proposal:

    fed      t   p1  p2  p3        (t: the row's last token; p: proposed)
    sampled  s0  s1  s2  s3        (s_j: the model's token after t p1 .. pj)
    kept     s0 .. sm              m = leading j with s_j == p_{j+1}; s_m is the correction,
                                   or the bonus token when every proposal held (m = k)

Each s_j is drawn exactly as a plain step would draw it at that place (same penalties, same
seeded key: fold_in(key(seed), tokens generated before it)), and a proposal is kept only where
the draw equals it. For a proposer that returns tokens (not distributions) this IS the
rejection rule of speculative sampling, with the proposal distribution one-hot: accept p with
probability P(p), else draw from P without p. So outputs keep the model's distribution
exactly; greedy and seeded outputs are the very tokens a plain run gives.

The K/V of rejected proposals stays in its slots and is overwritten later: the row's
num_computed_tokens counts only kept tokens (verify_steps.push_token).

Proposers (`Proposer`): `NgramProposer` (prompt lookup: what followed the latest earlier
occurrence of the context's last n tokens, n from prompt_lookup_max down to
prompt_lookup_min), `SelfDraft` (self-speculation: the model's own first layers and LM
head draft k tokens greedily, on the device: drafting.draft_tokens; its K/V for those layers
is what the verify step writes there too, so it needs no cache of its own) and `ModelDraft`
(a smaller model drafts greedily on the device, with its own K/V pool: draft_model.py).
Anything with `propose(token_ids, k) -> list[int]` can stand in (Engine.proposer), e.g. the
bench's replay proposer.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow `token_ids` (a request's prompt + output)."""


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
    last n tokens, for the longest n in [n_min, n_max] that occurs; none when none does."""

    n_min: int = 2
    n_max: int = 4

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        a = np.asarray(token_ids, np.int32)
        size = len(a)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            # Windows a[i:i+n] for i < size - n (the suffix itself excluded).
            windows = np.lib.stride_tricks.sliding_window_view(a[:-1], n)
            hits = np.flatnonzero((windows == a[size - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return a[start:start + k].tolist()
        return []


@dataclasses.dataclass(frozen=True)
class SelfDraft:
    """Self-speculation: the proposal is drafted on the device after the step is scheduled
    (Engine fills it in); `propose` only reserves its k places."""

    num_layers: int
    on_device = True

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [0] * k


@dataclasses.dataclass(frozen=True)
class ModelDraft:
    """A draft model drafts on the device after the step is scheduled (Engine fills the
    proposal in); `propose` only reserves its k places."""

    model: str
    on_device = True

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [0] * k


def make_proposer(config, num_layers: int = 0) -> Proposer | None:
    """The proposer an EngineConfig asks for; None when speculation is off. num_layers:
    the model's (self-speculation drafts with speculative_draft_layers of them, 0: half)."""
    if not config.num_speculative_tokens:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.speculative_method == "self":
        return SelfDraft(config.draft_layers(num_layers))
    if config.speculative_method == "draft":
        return ModelDraft(config.speculative_model)
    raise ValueError(f"unknown speculative_method {config.speculative_method!r}")


def accepted_count(sampled: Sequence[int], proposed: Sequence[int]) -> int:
    """How many proposals hold: the leading j with sampled[j] == proposed[j]."""
    m = 0
    for s, p in zip(sampled, proposed):
        if int(s) != int(p):
            break
        m += 1
    return m


@dataclasses.dataclass
class SpecStats:
    """What speculation did so far. A draft is one row's proposal in one step."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = None    # [k]: drafts whose proposal j held (j = 0 .. k-1)

    def __post_init__(self):
        if self.accepted_per_pos is None:
            self.accepted_per_pos = [0] * self.k

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a row gains per speculative step: 1 + accepted proposals per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, before: dict) -> dict:
        """What speculation did since `before` (an earlier as_dict()), in as_dict's form."""
        now = self.as_dict()
        diff = SpecStats(self.k, *(now[f] - before[f] for f in (
            "num_drafts", "num_draft_tokens", "num_accepted_tokens")),
            [a - b for a, b in zip(now["accepted_per_pos"], before["accepted_per_pos"])])
        return diff.as_dict()

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4)}
