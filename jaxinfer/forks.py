"""The n completions of one prompt in the scheduler (SamplingParams.n > 1).

The request runs alone until its prompt is computed; the step that samples its first token
forks the other n - 1 (`_fork`, at commit): each shares the prompt's full pages (reference
counts), gets a copy of the partly filled last page (the engine copies it on the device,
`take_copies`), and feeds the prompt's last token once more to sample its own first token.
Such a request is admitted only with rows for all n (`Scheduler._fork_rows`). A completion
cancelled before the fork never starts (`_cancel_fork`); if the request itself ends before
it, its completions run as requests of their own (Scheduler.finish).
"""
from __future__ import annotations

import bisect

from jaxinfer.page_table import PageList
from jaxinfer.request import FinishReason, Request, RequestStatus, rank


class Forks:
    """Scheduler's fork handling (a mixin: it reads the Scheduler's state)."""

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) KV pages to copy on the device before the next step
        runs (forks since the last call), in order; clears them."""
        copies, self._copies = self._copies, []
        return copies

    def _fork(self, parent: Request) -> None:
        """Start the completions `parent` forks (module docstring). Each shares the pages of
        the prompt's tokens before its last, and copies the page holding the last one when
        earlier prompt tokens fill part of it; when no page is free for that copy the
        completion waits at the head of the queue instead, to be admitted as any request
        (prefix caching then serves its full pages)."""
        page_size, alloc = self.page_size, self.allocator
        start = parent.num_prompt_tokens - 1   # each completion feeds the last prompt token
        shared = parent.page_ids[:start // page_size]
        partial = start % page_size != 0
        queued = []
        for rid, params in parent.forks:
            child = self._new_fork(parent, rid, params)
            if partial and alloc.num_free == 0:
                queued.append(child)
                continue
            alloc.share(shared)
            pages = list(shared)
            if partial:
                pages += alloc.allocate(1)
                self._copies.append((parent.page_ids[len(shared)], pages[-1]))
            child.page_ids = PageList(pages)
            child.page_keys = parent.page_keys[:len(shared)]
            child.num_cached_pages = min(parent.num_cached_pages, len(shared))
            child.num_computed_tokens = start
            child.status = RequestStatus.RUNNING
            self._lora_enter(child)    # always succeeds: the parent holds the adapter's slot
            bisect.insort(self.running, child, key=rank)
        self.waiting.extendleft(reversed(queued))
        self._fork_rows -= len(parent.forks)
        parent.forks = ()

    def _new_fork(self, parent: Request, request_id: str, params) -> Request:
        """A completion of `parent`'s prompt as a request of its own (registered, WAITING)."""
        child = Request(request_id, parent.prompt_token_ids, params,
                        arrival_time=parent.arrival_time, lora=parent.lora,
                        priority=parent.priority, deadline=parent.deadline)
        self.requests[request_id] = child
        self._reserved.discard(request_id)
        return child

    def _cancel_fork(self, request_id: str) -> Request:
        """A completion not forked yet, cancelled: taken out of its parent's forks and
        returned finished, with no tokens."""
        parent = next(r for r in self.requests.values()
                      if any(rid == request_id for rid, _ in r.forks))
        params = dict(parent.forks)[request_id]
        parent.forks = tuple(f for f in parent.forks if f[0] != request_id)
        if parent.status == RequestStatus.RUNNING:
            self._fork_rows -= 1
        self._reserved.discard(request_id)
        request = Request(request_id, parent.prompt_token_ids, params,
                          arrival_time=parent.arrival_time)
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.CANCELLED
        request.finish_time = self.clock()
        return request
