"""The n completions of one prompt (SamplingParams.n > 1) as the engine tracks them.

The scheduler runs each completion as a request of its own (`completion_id`), forked from the
first once the prompt is computed (scheduler.py). The engine holds their final outputs here
until the last one finishes, then hands out one RequestOutput for the request: `outputs`
lists the n completions in order, and its single-completion fields are completion 0's.
"""
from __future__ import annotations

import dataclasses

from jaxinfer.request import RequestOutput


def completion_id(request_id: str, index: int) -> str:
    """The scheduler's id of completion `index` of request `request_id`."""
    return f"{request_id}#{index}"


class RequestGroup:
    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.ids = [completion_id(request_id, i) for i in range(n)]
        self._final: dict[str, RequestOutput] = {}

    def add(self, output: RequestOutput) -> RequestOutput | None:
        """Keep one completion's final output; the request's output once all n are in."""
        self._final[output.request_id] = output
        if len(self._final) < len(self.ids):
            return None
        outs = [self._final[cid] for cid in self.ids]
        first = outs[0]
        ttfts = [o.ttft_s for o in outs if o.ttft_s is not None]
        latencies = [o.latency_s for o in outs if o.latency_s is not None]
        return dataclasses.replace(
            first, request_id=self.request_id, new_token_ids=[], text_delta="",
            completions=[o.completion(i) for i, o in enumerate(outs)],
            ttft_s=min(ttfts, default=None), latency_s=max(latencies, default=None),
            error=next((o.error for o in outs if o.error), None))


class RequestGroups:
    """The engine's n > 1 requests, by id and by their completions' ids."""

    def __init__(self):
        self._by_id: dict[str, RequestGroup] = {}
        self._of: dict[str, RequestGroup] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> RequestGroup | None:
        return self._by_id.get(request_id)

    def add(self, request_id: str, n: int) -> RequestGroup:
        group = self._by_id[request_id] = RequestGroup(request_id, n)
        for cid in group.ids:
            self._of[cid] = group
        return group

    def emit(self, outputs: list[RequestOutput], out: RequestOutput) -> list[RequestOutput]:
        """Add `out` to `outputs`; a completion of an n > 1 request is held until all n have
        finished (its intermediate outputs are dropped), then their one output is added."""
        group = self._of.get(out.request_id)
        if group is None:
            outputs.append(out)
        elif out.finished:
            del self._of[out.request_id]
            merged = group.add(out)
            if merged is not None:
                del self._by_id[group.request_id]
                outputs.append(merged)
        return outputs

    def count_requests(self, request_ids) -> int:
        """How many requests `request_ids` (the scheduler's) stand for: an n > 1 request once."""
        return (sum(1 for rid in request_ids if rid not in self._of)
                + len({self._of[rid].request_id for rid in request_ids if rid in self._of}))
