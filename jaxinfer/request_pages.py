"""A request's KV pages in the scheduler: growing them for its next tokens, preempting the
last running request when the pool runs dry, admitting a waiting request (prefix-cache hits
first), releasing them, and registering full pages in the prefix cache.

Order of preemption (Scheduler's module docstring): the last running request in rank order
(the newest of the lowest priority) gives its pages up and goes back to the queue ahead of
every waiting request of its priority.
"""
from __future__ import annotations

from jaxinfer.page_table import PageList, extend_page_keys
from jaxinfer.request import Request, RequestStatus


class RequestPages:
    """Scheduler's page handling (a mixin: it reads the Scheduler's state)."""

    def _grow(self, request: Request, n: int) -> bool:
        """Give the request pages for n more tokens, if the pool has them."""
        need = self.allocator.pages_for(request.num_computed_tokens + n) - len(request.page_ids)
        if need <= 0:   # the common decode step: the last page still has room
            return True
        if need > self.allocator.num_free:
            return False
        request.page_ids.extend(self.allocator.allocate(need))
        return True

    def _make_room(self, request: Request, n: int, preempted: list[str]) -> bool:
        while not self._grow(request, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._lora_leave(request)
        self._fork_rows -= len(request.forks)
        self._release_pages(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Ahead of every waiting request of its priority (all of them by default).
        waiting, i = self.waiting, 0
        while i < len(waiting) and waiting[i].priority < request.priority:
            i += 1
        waiting.insert(i, request)

    def _admit(self, request: Request, budget: int) -> int:
        """Take prefix-cache hits and pages for the first chunk; the chunk length, 0 if the
        pool cannot hold it (then the request keeps nothing)."""
        if self.allocator.enable_prefix_caching:
            extend_page_keys(request.page_keys, request.all_token_ids, self.page_size,
                             root=_root(request))
            # At least one token must be computed, for the logits of the next token; every
            # prompt token, for its logprob (prompt_logprobs.py).
            usable = (request.page_keys[:(request.num_tokens - 1) // self.page_size]
                      if request.sampling_params.prompt_logprobs is None else [])
            request.page_ids = PageList(self.allocator.match_prefix(usable))
            request.num_cached_pages = len(request.page_ids)
            request.num_computed_tokens = len(request.page_ids) * self.page_size
        n = min(request.num_uncomputed_tokens, budget)
        if not self._grow(request, n):
            self._release_pages(request)
            return 0
        request.num_prefix_hit_tokens = request.num_computed_tokens
        self.allocator.record_query(request.num_tokens, request.num_computed_tokens)
        return n

    def _release_pages(self, request: Request) -> None:
        self.allocator.free(reversed(request.page_ids))
        request.page_ids = PageList()
        request.num_computed_tokens = 0
        request.num_cached_pages = 0
        request.num_draft_computed = 0

    def _cache_full_pages(self, request: Request) -> None:
        if not self.allocator.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.page_size
        if full <= request.num_cached_pages:
            return
        # Computed tokens only: a trailing PENDING token must never be hashed into a key.
        extend_page_keys(request.page_keys, request.all_token_ids, self.page_size,
                         full * self.page_size, _root(request))
        for i in range(request.num_cached_pages, full):
            self.allocator.cache_page(request.page_ids[i], request.page_keys[i])
        request.num_cached_pages = full


def _root(request: Request) -> bytes | None:
    """What the request's prefix-cache keys chain from: its adapter's key (or nothing)."""
    return None if request.lora is None else request.lora.encode()
