"""The scheduler's side of speculative decoding (a mixin of Scheduler: it reads its running
requests, allocator and limits): a verify step's rows (each running request's last token and
its proposal, cut to the room its limits leave), and the tokens a verify step keeps, pushed
one at a time through the finishing rules (speculative.py has the rule)."""
from __future__ import annotations

from typing import Sequence

from jaxinfer.request import FinishReason, Request, RequestStatus
from jaxinfer.scheduler_output import ScheduledRow, SchedulerOutput


class VerifySteps:
    def _schedule_verify(self, drafts: dict[str, Sequence[int]]) -> SchedulerOutput:
        rows: list[ScheduledRow] = []
        preempted: list[str] = []
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue     # preempted for an older request's pages this step
            if request.num_pending or request.num_uncomputed_tokens != 1:
                raise RuntimeError(f"request {request.request_id!r} is not in decode with "
                                   f"nothing pending: it cannot take a proposal")
            # Every kept token but the last is fed back: proposals fit in the room left.
            room = min(request.sampling_params.max_tokens - request.num_output_tokens,
                       self.max_model_len - request.num_tokens) - 1
            draft = tuple(drafts.get(request.request_id, ()))[:max(room, 0)]
            n = 1 + len(draft)
            if not self._make_room(request, n, preempted):
                continue
            start = request.num_computed_tokens
            rows.append(ScheduledRow(request.request_id, (request.all_token_ids[start], *draft),
                                     start, request.page_ids.array(), True))
        return SchedulerOutput(tuple(r for r in rows if r.request_id not in preempted),
                               tuple(preempted), verify=True)

    def push_token(self, request: Request, token: int, fed: bool) -> bool:
        """A token a verify step kept for `request`, in order: appended, and the finishing
        rules applied (as `resolve` does for one). `fed`: it equals the proposal that was fed
        in its place, so its K/V is in the cache and it counts as computed (every kept token
        but the last). Returns whether the request finished."""
        self.deadlines.changed()
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
        if fed:
            request.num_computed_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        params, count = request.sampling_params, request.num_output_tokens
        if token in params.stop_token_ids or (not params.ignore_eos
                                              and token in self.eos_token_ids):
            self.finish(request.request_id, FinishReason.STOP)
        elif self._at_length_limit(request, count):
            self.finish(request.request_id, FinishReason.LENGTH)
        return request.is_finished

    def settle(self, request: Request) -> None:
        """After a verify step's tokens for `request` are pushed: register its newly full
        pages in the prefix cache."""
        if (not request.is_finished and self.allocator.enable_prefix_caching
                and request.num_computed_tokens // self.page_size > request.num_cached_pages):
            self._cache_full_pages(request)
