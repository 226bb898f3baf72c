"""Requests in and out of the engine (a mixin of Engine: it reads the engine's scheduler,
tokenizer, text and grammar state): a prompt validated, tokenized and queued with its
priority and deadline (add_request), and a request cancelled (abort_request)."""
from __future__ import annotations

from jaxinfer.engine_io import Detokenized, check_params_for_model, prompt_token_ids
from jaxinfer.errors import InvalidRequestError
from jaxinfer.prompt_logprobs import PromptLogprobs
from jaxinfer.request import FinishReason, Request, RequestOutput, SamplingParams
from jaxinfer.request_group import completion_id
from jaxinfer.slo import deadline_at


class EngineRequests:
    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, *, priority: int = 0,
                    deadline: float | None = None) -> str:
        """Queue a request (text, chat messages, or {"prompt_token_ids": [...]}); returns its
        id. priority: the queue takes lower values first, then arrival order. deadline:
        seconds from now by which it must finish; one the engine predicts it cannot meet is
        refused with DeadlineError (slo.py)."""
        params = SamplingParams() if sampling_params is None else SamplingParams.coerce(
            sampling_params)
        now = self.scheduler.clock()
        timing = dict(arrival_time=now, priority=priority, deadline=deadline_at(now, deadline))
        ids = self.encode_prompt(prompt, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._groups:
            raise InvalidRequestError(f"request id {rid!r} is already in use",
                                      field="request_id")
        text = prompt if isinstance(prompt, str) else None
        lora = self._lora_key(params.lora)
        if params.n == 1:
            self.scheduler.add(Request(rid, ids, params, lora=lora, **timing))
            self._keep_prompt_logprobs(rid, ids, params)
            self._text[rid] = Detokenized(self.tokenizer, ids, params, text)
            self._grammars.add(rid, params)
            return rid
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use",
                                      field="request_id")
        cids = [completion_id(rid, i) for i in range(params.n)]
        each = [params.for_completion(i) for i in range(params.n)]
        self.scheduler.add(Request(cids[0], ids, each[0], forks=tuple(zip(cids[1:], each[1:])),
                                   lora=lora, **timing))
        self._keep_prompt_logprobs(cids[0], ids, params)
        for cid, p in zip(cids, each):
            self._text[cid] = Detokenized(self.tokenizer, ids, p, text)
            self._grammars.add(cid, p)
        self._groups.add(rid, params.n)
        return rid

    def _keep_prompt_logprobs(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        if params.prompt_logprobs is not None:   # completion 0's of an n > 1 request
            self._prompt_lp[rid] = PromptLogprobs(ids, params.prompt_logprobs)

    def encode_prompt(self, prompt, sampling_params: SamplingParams) -> list[int]:
        """A prompt's validated token ids (and `sampling_params` checked against this model):
        what add_request does before queueing. Safe from any thread (servers tokenize off
        the engine's thread, then add {"prompt_token_ids": ids})."""
        check_params_for_model(sampling_params, self.tokenizer, self.model_config.vocab_size)
        self._lora_key(sampling_params.lora)     # an adapter that is loaded
        self._grammars.check(sampling_params)    # a grammar is compiled (and cached) here
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size,
                                self.config.max_model_len)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request, or one completion of an n > 1 request by its id (`req#i`); its
        pages are free for the next step. Returns the cancelled request's final output; for
        a completion, the whole request's if no other completion is left running, else None
        (a later step returns it). Unknown ids are ignored."""
        group = self._groups.get(request_id)
        if group is not None:
            done = [self._abort_one(cid) for cid in group.ids]
            return next((o for o in done if o is not None), None)
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        out = self._output(req, [], self._text[request_id].finish(), FinishReason.CANCELLED)
        self._forget(request_id)
        got = self._groups.emit([], out)
        return got[0] if got else None
