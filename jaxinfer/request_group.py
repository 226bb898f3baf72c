"""The n completions of one prompt (SamplingParams.n > 1) as the engine tracks them.

The scheduler runs each completion as a request of its own (`completion_id`), forked from the
first once the prompt is computed (scheduler.py). The engine holds their final outputs here
until the last one finishes, then hands out one RequestOutput for the request: `outputs`
lists the n completions in order, and its single-completion fields are completion 0's.
Stepping with deltas (streaming), each completion's progress also comes out as it happens:
an unfinished RequestOutput of the request whose `outputs` is that one completion (its
`index`, and its `finish_reason` once it ended); its delta fields are that completion's.
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
        self._index = {cid: i for i, cid in enumerate(self.ids)}
        self._final: dict[str, RequestOutput] = {}

    def delta(self, output: RequestOutput) -> RequestOutput:
        """One completion's output as an unfinished output of the request (module doc)."""
        return dataclasses.replace(
            output, request_id=self.request_id, finish_reason=None, error=None,
            completions=[output.completion(self._index[output.request_id])])

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

    def emit(self, outputs: list[RequestOutput], out: RequestOutput,
             deltas: bool = False) -> list[RequestOutput]:
        """Add `out` to `outputs`; a completion of an n > 1 request is held until all n have
        finished, then their one output is added. With `deltas` the completion's output is
        also added as the request's unfinished output (module doc); without, only the final
        one is."""
        group = self._of.get(out.request_id)
        if group is None:
            outputs.append(out)
            return outputs
        if deltas:
            outputs.append(group.delta(out))
        if out.finished:
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
