"""Iteration-level scheduling: which requests run in the next step, and how many tokens each.

Each step mixes the decode tokens of running requests with prefill chunks of waiting ones,
under two caps: `max_num_batched_tokens` tokens and `max_num_seqs` rows. One rule covers every
case (see request.py): a scheduled request feeds the next `n` of its uncomputed tokens, where
`n` is all of them if the budget allows, else what is left of the budget (chunked prefill).
Only the row whose chunk reaches the end of the request's tokens yields a sampled token.

Order and priority (first come, first served; a request's `priority`, lower first, orders the
queue before its arrival does; its `deadline` may refuse it at `add`: slo.py):
1. Running requests, by priority then oldest first (`rank`). Each needs pages for its new
   tokens; when none are free, the last running request in that order (the most recently
   arrived of the lowest priority, vLLM's choice) is preempted: its pages are freed, it goes
   back to the queue ahead of every waiting request of its priority and later recomputes
   prompt + generated tokens (which it keeps). The first request is therefore never
   preempted, so it always finishes: `add` rejects any request that could not fit in the
   pool on its own.
2. Waiting requests, in queue order, while rows, budget and pages last; none in a step that
   preempted (admitting then would only thrash). A waiting request first takes the cached
   pages of its leading full pages (prefix caching), keeping at least one token to compute so
   the step yields logits. Head-of-line blocking: if the head does not fit, nobody passes it.
3. The step's size against the compiled shapes: a step that would be padded up to the next
   mixed shape has its last prefill chunk cut to fill the shape below, where that computes
   more real tokens per unit of step time (`buckets.fitted_tokens`).

n completions of one prompt (SamplingParams.n): forked from the first once its prompt is
computed, sharing its pages (forks.py).

Speculative decoding (speculative.py): `schedule(drafts)` gives each running request in
decode with a proposal its last token plus the proposed ones, a `verify` step: nothing is
PENDING after its commit (the kept tokens are not known until it is read) and the engine
reads it before scheduling again, handing each kept token to `push_token` (verify_steps.py).

LoRA (max_loras > 0): a running request holds its adapter's device slot (lora.LoRASlots); a
waiting request whose adapter finds no slot waits at the head of the queue like one that
does not fit. Its prefix-cache keys chain from the adapter's key.

All decisions of a step are returned in one `SchedulerOutput`; `update` applies the sampled
tokens, advances counters, registers newly filled pages in the prefix cache and applies the
finishing rules (stop/eos token ids, max_tokens, max_model_len). Stop *strings* need text, so
the engine checks them and calls `finish`. `update` is `commit` (at dispatch: tokens computed,
a PENDING output token per sampling row) then `resolve` (tokens known); with async
scheduling the engine schedules the next step between the two (engine.py).
"""
from __future__ import annotations

import bisect
import collections
import time
from typing import Callable, Sequence

from jaxinfer.buckets import fitted_tokens
from jaxinfer.config import EngineConfig
from jaxinfer.errors import InvalidRequestError
from jaxinfer.forks import Forks
from jaxinfer.request_pages import RequestPages
from jaxinfer.lora import LoRASlots
from jaxinfer.page_table import PageAllocator
from jaxinfer.request import (MAX_BANNED_IDS, PENDING, FinishReason, Request, RequestStatus,
                              rank)
from jaxinfer.scheduler_output import ScheduledRow, SchedulerOutput
from jaxinfer.slo import Deadlines
from jaxinfer.verify_steps import VerifySteps

__all__ = ["Scheduler", "ScheduledRow", "SchedulerOutput"]


class Scheduler(RequestPages, Forks, VerifySteps):
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, page_size: int,
                 num_pages: int, max_model_len: int, enable_prefix_caching: bool = True,
                 eos_token_ids: Sequence[int] = (), max_loras: int = 0,
                 itl_target_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.allocator = PageAllocator(num_pages, page_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}   # unfinished requests by id
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []          # sorted by rank: priority, then arrival
        self.num_preemptions = 0
        self._fork_rows = 0          # rows the running requests' forks will take
        self._reserved: set[str] = set()   # ids of completions not forked yet
        self._copies: list[tuple[int, int]] = []   # (src, dst) pages, for take_copies
        self.lora_slots = LoRASlots(max_loras) if max_loras else None
        self.deadlines = Deadlines(self, itl_target_s=itl_target_s)
        # The token counts of the compiled mixed shapes (buckets.Buckets.mixed_sizes), set
        # by the engine: a step that would be padded up to one may be cut down to the one
        # below (buckets.fitted_tokens). Empty: steps are never cut.
        self.token_shapes: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: EngineConfig, eos_token_ids: Sequence[int] = (),
                    **kw) -> "Scheduler":
        return cls(max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   page_size=config.page_size, num_pages=config.total_pages,
                   max_model_len=config.max_model_len,
                   enable_prefix_caching=config.enable_prefix_caching,
                   eos_token_ids=eos_token_ids, max_loras=config.max_loras,
                   itl_target_s=config.itl_target_ms / 1e3, **kw)

    # --- requests in and out ------------------------------------------------------------
    def add(self, request: Request) -> None:
        ids = [request.request_id, *(rid for rid, _ in request.forks)]
        taken = [rid for rid in ids if rid in self.requests or rid in self._reserved]
        if taken or len(set(ids)) != len(ids):
            raise InvalidRequestError(f"request id {(taken or ids)[0]!r} is already in use",
                                      field="request_id")
        if len(ids) > self.max_num_seqs:
            raise InvalidRequestError(f"n is {len(ids)}; this engine runs at most "
                                      f"{self.max_num_seqs} sequences at once (max_num_seqs)",
                                      field="n")
        if request.lora is not None and self.lora_slots is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (max_loras is 0)",
                                      field="lora")
        if request.num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_tokens} tokens; max_model_len is {self.max_model_len},"
                f" which leaves no room for an answer", field="prompt_token_ids")
        if len(self.banned_ids(request, 0)) > MAX_BANNED_IDS:
            raise InvalidRequestError(
                f"with min_tokens, EOS and stop_token_ids may hold at most {MAX_BANNED_IDS} "
                f"ids", field="stop_token_ids")
        final_len = min(request.num_prompt_tokens + request.sampling_params.max_tokens,
                        self.max_model_len)
        # The last token is never fed back, so its K/V never needs a slot.
        if self.allocator.pages_for(final_len - 1) > self.allocator.num_usable:
            raise InvalidRequestError(
                f"request needs up to {final_len - 1} tokens of KV cache; the pool holds "
                f"{self.allocator.num_usable * self.page_size}", field="max_tokens")
        self.deadlines.check(request)     # DeadlineError: predicted to finish late
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._reserved.update(ids[1:])
        # After every waiting request of its priority or better (all of them by default).
        waiting, i = self.waiting, len(self.waiting)
        while i and waiting[i - 1].priority > request.priority:
            i -= 1
        waiting.insert(i, request)
        self.deadlines.added(request)

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request (or one of n completions, forked or not); unknown or already
        finished ids are ignored (None)."""
        if request_id in self._reserved:
            return self._cancel_fork(request_id)
        if request_id not in self.requests:
            return None
        return self.finish(request_id, FinishReason.CANCELLED)

    def finish(self, request_id: str, reason: FinishReason) -> Request:
        """Finish a request for a reason found outside (e.g. a stop string); frees its pages."""
        if request_id not in self.requests:
            raise KeyError(f"no unfinished request {request_id!r}")
        request = self.requests.pop(request_id)
        self._drop_pending(request)   # sampled but never seen: not part of the answer
        forks, request.forks = request.forks, ()
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._fork_rows -= len(forks)
            self._lora_leave(request)
        else:
            self.waiting.remove(request)
        # Completions it was to fork run on their own, first in the queue.
        self.waiting.extendleft(reversed([self._new_fork(request, *f) for f in forks]))
        self._release_pages(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = self.clock()
        self.deadlines.changed()
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.deadlines.finished(request)
        return request

    def recover(self, failed: Sequence[str], cache_lost: bool) -> list[Request]:
        """After a step failed: finish the `failed` requests (FinishReason.ERROR, pages freed)
        and send every other running request back to the head of the queue, pages released
        and PENDING tokens dropped, to be recomputed from its known tokens (the steps in
        flight are gone). `cache_lost`: the KV cache was rebuilt, so the prefix cache is
        forgotten too. Returns the failed requests."""
        self.deadlines.changed()
        done = [self.finish(rid, FinishReason.ERROR) for rid in failed if rid in self.requests]
        for request in self.running[::-1]:
            self._preempt(request)      # last first: the first ends up in front
        for request in self.waiting:
            self._drop_pending(request)
        if cache_lost:
            self.allocator.forget_cache()
        self._copies.clear()   # their destinations were released with the requests
        return done

    def _drop_pending(self, request: Request) -> None:
        if request.num_pending:  # sampled but never seen
            del request.output_token_ids[-request.num_pending:]
            del request.all_token_ids[-request.num_pending:]
            request.num_pending = 0

    def get(self, request_id: str) -> Request:
        return self.requests[request_id]

    @property
    def free_rows(self) -> int:
        """Rows a step could still give waiting requests (the running ones' forks count)."""
        return self.max_num_seqs - len(self.running) - self._fork_rows

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, float]:
        a = self.allocator
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_preemptions": self.num_preemptions, "kv_pages_used": a.num_used,
                "kv_usage": a.num_used / a.num_usable, "prefix_cache_hit_rate": a.hit_rate,
                "prefix_cache_hit_tokens": a.hit_tokens,
                "prefix_cache_queried_tokens": a.queried_tokens}

    # --- one step -----------------------------------------------------------------------
    def schedule(self, drafts: dict[str, Sequence[int]] | None = None) -> SchedulerOutput:
        """The next step. `drafts` (request id -> proposed tokens): a speculative step, for
        an engine that checked every running request is in decode with nothing pending and
        none is waiting: each request is fed its last token and its proposal, cut to what
        its length limits leave room for."""
        self.deadlines.changed()
        if drafts:
            return self._schedule_verify(drafts)
        budget = self.max_num_batched_tokens
        if self.running and self.deadlines.itl_target_s:
            budget = self.deadlines.step_budget(budget)     # decode rows keep their ITL
        step_budget = budget
        rows: list[ScheduledRow] = []
        preempted: list[str] = []
        i = 0
        running, page_size, max_len = self.running, self.page_size, self.max_model_len
        while i < len(running) and budget > 0:
            request = running[i]
            tokens = request.all_token_ids
            total = len(tokens)
            if request.num_pending and (total >= request.max_total_tokens or total >= max_len):
                i += 1   # its pending token is its last: nothing more to compute
                continue
            start = request.num_computed_tokens
            n = min(total - start, budget)
            pages = request.page_ids.view
            # The common decode step needs no new page (inline _grow's first test).
            if -(-(start + n) // page_size) > len(pages):
                if not self._make_room(request, n, preempted):
                    break   # the request itself was the newest and got preempted
                pages = request.page_ids.view
            rows.append(ScheduledRow(request.request_id, tuple(tokens[start:start + n]), start,
                                     pages, start + n == total))
            budget -= n
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) + self._fork_rows < self.max_num_seqs):
            request = self.waiting[0]
            if request.num_pending:
                break    # preempted with a token in flight: readmit once it is known
            if len(self.running) + self._fork_rows + 1 + len(request.forks) > self.max_num_seqs:
                break    # rows for all n completions
            if not self._lora_enter(request):
                break    # every adapter slot is held by running requests
            n = self._admit(request, budget)
            if n == 0:
                self._lora_leave(request)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self._fork_rows += len(request.forks)
            bisect.insort(self.running, request, key=rank)
            rows.append(self._row(request, n))
            budget -= n
        if self.token_shapes and rows and not preempted:
            self._fit_shape(rows, step_budget - budget)
        return SchedulerOutput(tuple(rows), tuple(preempted))

    def _fit_shape(self, rows: list[ScheduledRow], total: int) -> None:
        """Cut the step's last row to what buckets.fitted_tokens keeps (the cut tokens wait
        for the next step; the request keeps the pages it got for them). Only the last row
        is cut, and only while it keeps a token: no admission is undone. total: the step's
        tokens (the budget it used)."""
        last = rows[-1]
        keep = fitted_tokens(total, len(rows), len(last.token_ids), self.token_shapes)
        if keep < len(last.token_ids):
            rows[-1] = last._replace(token_ids=last.token_ids[:keep], samples=False)

    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Apply one step's results (`commit` then `resolve`: the synchronous engine).
        `sampled_token_ids[i]` belongs to `output.rows[i]` and is ignored for rows that do
        not sample; it may be the bucket-padded [B] array (entries past the real rows are
        ignored). Returns the requests that got a token, in row order; finished ones have
        status FINISHED and a finish_reason."""
        self.commit(output)
        return self.resolve(output, sampled_token_ids)

    def commit(self, output: SchedulerOutput) -> None:
        """The step is dispatched: its tokens count as computed, and each sampling row gets a
        PENDING output token until `resolve`. The next `schedule` may run before that (async
        scheduling): a PENDING token is then fed from the device (step_input.StepInput)."""
        self.deadlines.changed()
        requests, verify = self.requests, output.verify
        for rid, token_ids, start, _, samples in output.rows:
            request = requests.get(rid)
            if request is None:
                continue   # finished from outside between schedule and commit
            if request.num_computed_tokens != start:
                raise RuntimeError(f"stale scheduler output for {rid!r}")
            if verify:   # the last token is computed; proposals count once kept
                request.num_computed_tokens = start + 1
                continue
            request.num_computed_tokens = start + len(token_ids)
            if samples:
                request.output_token_ids.append(PENDING)
                request.all_token_ids.append(PENDING)
                request.num_pending += 1
                if request.forks:   # its prompt is computed: the other completions start
                    self._fork(request)

    def banned_ids(self, request: Request, count: int | None = None) -> list[int]:
        """The ids `request` may not sample after `count` output tokens (default: its own
        count): EOS (unless ignore_eos) and its stop token ids, while short of min_tokens."""
        params = request.sampling_params
        count = request.num_output_tokens if count is None else count
        if count >= params.min_tokens:
            return []
        eos = () if params.ignore_eos else self.eos_token_ids
        return sorted(set(params.stop_token_ids) | set(eos))

    def resolve(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[Request]:
        """A committed step's sampled tokens arrived: fill each row's oldest PENDING token,
        register newly full pages in the prefix cache, apply the finishing rules. Returns the
        requests that got a token (see `update`)."""
        return [request for _, request in self.resolve_rows(output, sampled_token_ids)]

    def resolve_rows(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]
                     ) -> list[tuple[int, Request]]:
        """`resolve`, returning (row, request) of the rows that got a token, in row order."""
        self.deadlines.changed()
        if len(sampled_token_ids) < output.num_rows:
            raise ValueError(f"got {len(sampled_token_ids)} sampled tokens for "
                             f"{output.num_rows} scheduled rows")
        now = self.clock()
        updated = []
        requests, page_size, max_len = self.requests, self.page_size, self.max_model_len
        caching, eos = self.allocator.enable_prefix_caching, self.eos_token_ids
        for b, (row, token) in enumerate(zip(output.rows, sampled_token_ids)):
            request = requests.get(row.request_id)
            if request is None:
                continue   # finished (or aborted) after this step was scheduled
            if not row.samples:
                if caching and request.num_computed_tokens // page_size > request.num_cached_pages:
                    self._cache_full_pages(request)
                continue
            if not request.num_pending:
                raise RuntimeError(f"no pending token for {row.request_id!r}")
            token = int(token)
            outputs = request.output_token_ids
            count = len(outputs) - request.num_pending + 1   # this token's place (1-based)
            outputs[count - 1] = token
            n_prompt = len(request.prompt_token_ids)
            request.all_token_ids[n_prompt + count - 1] = token
            request.num_pending -= 1
            if request.first_token_time is None:
                request.first_token_time = now
            # After the token is in: a page is cached only once all its tokens are known.
            if caching and request.num_computed_tokens // page_size > request.num_cached_pages:
                self._cache_full_pages(request)
            params = request.sampling_params
            if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
                self.finish(request.request_id, FinishReason.STOP)
            elif count >= params.max_tokens or n_prompt + count >= max_len:
                self.finish(request.request_id, FinishReason.LENGTH)
            updated.append((b, request))
        return updated

    # --- helpers ------------------------------------------------------------------------
    def _at_length_limit(self, request: Request, count: int) -> bool:
        """`count` output tokens reach max_tokens or max_model_len."""
        total = request.num_prompt_tokens + count
        return total >= request.max_total_tokens or total >= self.max_model_len

    def _row(self, request: Request, n: int) -> ScheduledRow:
        start = request.num_computed_tokens
        return ScheduledRow(request.request_id, tuple(request.all_token_ids[start:start + n]),
                            start, request.page_ids.array(), start + n == request.num_tokens)

    def _lora_enter(self, request: Request) -> bool:
        """The request's adapter takes (or shares) a slot as it starts running; False: none."""
        return request.lora is None or self.lora_slots.enter(request.lora)

    def _lora_leave(self, request: Request) -> None:
        if request.lora is not None:
            self.lora_slots.leave(request.lora)
