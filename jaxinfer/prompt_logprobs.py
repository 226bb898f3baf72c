"""Prompt logprobs (SamplingParams.prompt_logprobs), as vLLM's RequestOutput.prompt_logprobs:
for each prompt token, its raw logprob given the tokens before it (and its rank, and the
top-n there); None for the first token.

The step computes them (sampling.prompt_logprobs) for the prompt tokens it feeds of a request
that asks: a token fed at position p gets the target prompt[p + 1], and its result becomes
entry p + 1 of the request's list. Such a request never takes prefix-cache hits (a cached
token is not fed, so its logprob would not exist); its own pages are still cached for
others. Once every entry is in, recomputing the request (after a preemption) asks for
nothing more. Host side only: no jax."""
from __future__ import annotations

import numpy as np

from jaxinfer.engine_io import ranked_dict
from jaxinfer.request import PromptLogprobDicts
from jaxinfer.scheduler_output import SchedulerOutput


class PromptLogprobs:
    """One request's prompt logprobs as they come in."""

    def __init__(self, prompt_ids, n: int):
        self.ids, self.n = list(prompt_ids), n
        self.entries: PromptLogprobDicts = [None] * len(self.ids)
        self._missing = len(self.ids) - 1

    @property
    def done(self) -> bool:
        return self._missing == 0

    def span(self, start: int, count: int) -> int:
        """How many of `count` tokens fed from position `start` have a target."""
        return max(0, min(count, len(self.ids) - 1 - start))

    def record(self, start: int, count: int, prompt, at: int, token_text=None) -> None:
        """Take the results of `count` tokens fed from position `start`, row-major at index
        `at` of the step's PromptLogprobOutput `prompt` (numpy)."""
        for i in range(self.span(start, count)):
            p, t = start + i, at + i
            if self.entries[p + 1] is None:
                self._missing -= 1
            self.entries[p + 1] = ranked_dict(prompt.top_ids[t], prompt.top_logprobs[t],
                                              self.n, self.ids[p + 1], prompt.logprob[t],
                                              prompt.rank[t], token_text)


def step_targets(out: SchedulerOutput, num_tokens: int, wanted: dict[str, PromptLogprobs]
                 ) -> np.ndarray | None:
    """The step's [num_tokens] i32 prompt targets (-1: none) for the requests in `wanted`
    whose prompt logprobs are not all in; None when no token of the step has one."""
    targets, at = None, 0
    for row in out.rows:
        lp = wanted.get(row.request_id)
        if lp is not None and not lp.done:
            k = lp.span(row.start_pos, row.num_tokens)
            if k:
                if targets is None:
                    targets = np.full(num_tokens, -1, np.int32)
                targets[at:at + k] = lp.ids[row.start_pos + 1:row.start_pos + 1 + k]
        at += row.num_tokens
    return targets


def record_step(out: SchedulerOutput, prompt, wanted: dict[str, PromptLogprobs],
                token_text=None) -> None:
    """A step's PromptLogprobOutput (numpy) into the requests of `wanted` it fed."""
    at = 0
    for row in out.rows:
        lp = wanted.get(row.request_id)
        if lp is not None and not lp.done:
            lp.record(row.start_pos, row.num_tokens, prompt, at, token_text)
        at += row.num_tokens
