"""The engine's outputs (a mixin of Engine: it reads the engine's scheduler, runner and text
state): a dispatched step's tokens into its requests and their grammars, then its text
deltas, stop strings and logprobs into RequestOutputs. The tokens come first and the text
may wait: a step whose penalty windows or grammar masks need the previous step's tokens
takes them, is dispatched, and only then does the previous step's text work. When a step reads
the step in flight: `_read_early` (before scheduling, where the next step depends on it),
`_read_late` (after dispatching)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

import numpy as np

from jaxinfer.dispatch_thread import resolve
from jaxinfer.engine_io import logprob_dict
from jaxinfer.prompt_logprobs import record_step
from jaxinfer.request import FinishReason, Request, RequestOutput
from jaxinfer.sampling_columns import uses_penalty
from jaxinfer.scheduler_output import SchedulerOutput
from jaxinfer.sharding import fetch

log = logging.getLogger("jaxinfer.engine")


class EngineOutputs:
    def _read_early(self, prev):
        """Before scheduling: the step in flight read now where the next step depends on
        it. Returns (the step still in flight or None, a callable returning its outputs
        whose text work waits until the next step is dispatched or None, whether the next
        step's grammar masks are filled while its forward pass runs)."""
        if prev is None:
            return None, None, False
        if self._may_speculate():     # the proposals need every request's last token
            self._outputs += self._finish(prev)
            self._inflight = None
            return None, None, False
        if prev.waits and (need := self._needs_last_tokens()):
            if need == "grammar" and self.runner.mirror is None:
                return prev, None, True
            # Penalty windows need the tokens now; their text can wait until this step is
            # on the device.
            later = self._finish(prev, text_later=True)
            self._inflight = None
            return None, later, False
        return prev, None, False

    def _read_late(self, out: SchedulerOutput, prev, later, new) -> None:
        """After dispatching: the text work left for later, the step before (async
        scheduling), or this one (synchronous, or a verify step, whose tokens decide the
        next)."""
        if later is not None:
            self._outputs += later()
        if prev is not None:
            self._outputs += self._finish(prev)
        if new is not None and (not self.config.async_scheduling or out.verify):
            self._outputs += self._finish(new)
            new = None
        self._inflight = new

    def _needs_last_tokens(self) -> str | None:
        """Why the next step needs the pending tokens of the step in flight: "penalty" (a
        running request's penalty window), else "grammar" (a running request's next token
        bitmask), else None."""
        need = None
        for r in self.scheduler.running:
            if r.num_pending:
                if uses_penalty(r.sampling_params):
                    return "penalty"
                if r.request_id in self._grammars:
                    need = "grammar"
        return need

    def _finish(self, step, text_later: bool = False):
        """The outputs of a step on the device, once it is done; text_later: the requests
        take their tokens (and grammars) now, and a callable returns the outputs (text,
        stop strings, logprobs), its work left for later."""
        self._blame = step.out
        if self.runner.fault_hook is not None:
            self.runner.fault_hook("fetch", self.runner)
        self._wait_hook()
        t = time.perf_counter()
        sampled = resolve(step.sampled)
        self.last_device = (self._device_clock.wait(sampled, resolve(step.enqueued)), step.out)
        sampled = (dataclasses.replace(sampled, tokens=fetch(sampled.tokens))
                   if step.tokens_only and sampled.prompt is None else fetch(sampled))
        self._waited += time.perf_counter() - t
        if step.out.verify:
            return self._update_verify(step.out, sampled)
        text = functools.partial(self._text_outputs, self._take_tokens(step.out, sampled),
                                 sampled)
        if text_later:
            self._later = text
            return self._take_later
        return text()

    def _take_later(self) -> list[RequestOutput]:
        later, self._later = self._later, None
        return later() if later is not None else []

    def _take_tokens(self, out: SchedulerOutput, sampled) -> list:
        """A step's tokens into its requests and their grammars: [(row, request, token,
        grammar complete, or the exception the grammar raised)]. A complete grammar ends the
        request as a stop token or string would, and a failed one fails it, at once: neither
        may be scheduled again."""
        if sampled.prompt is not None:
            record_step(out, sampled.prompt, self._prompt_lp, self._token_text)
        tokens = np.asarray(sampled.tokens[:out.num_rows]).tolist()
        rows = self.scheduler.resolve_rows(out, tokens)
        self.num_generated += len(rows)
        advanced = {}
        if self._grammars.matchers:
            live = [(b, req) for b, req in rows if not req.is_finished]
            try:
                advanced = dict(zip((b for b, _ in live), self._grammars.advance_all(
                    [(req.request_id, tokens[b]) for b, req in live])))
            except Exception as e:   # fails the grammar rows, not the step
                advanced = {b: e for b, req in live if req.request_id in self._grammars}
        if not advanced:   # no grammar row: every row takes its token as it is
            return [(b, req, tokens[b], False) for b, req in rows]
        taken = []
        for b, req in rows:
            done = advanced.get(b, False)
            if done is True and not req.is_finished:
                self.scheduler.finish(req.request_id, FinishReason.STOP)
            elif isinstance(done, Exception) and not req.is_finished:
                self.scheduler.finish(req.request_id, FinishReason.ERROR)
            taken.append((b, req, tokens[b], done))
        return taken

    def _text_outputs(self, taken: list, sampled) -> list[RequestOutput]:
        """The outputs of the rows `_take_tokens` took: text deltas, stop strings and
        logprobs."""
        outputs, deferred = [], not self._deltas
        for b, req, token, grammar_done in taken:
            if isinstance(grammar_done, Exception):
                self._text_failed(outputs, req, grammar_done)
                continue
            text = self._text[req.request_id]
            # Final outputs only, the row goes on and nothing to look for: the token is kept
            # for the text's one decode at the end, and the row has no output this step.
            if (deferred and grammar_done is False and not req.is_finished
                    and req.sampling_params.logprobs is None and text.keep(token)):
                continue
            try:
                delta, stop_hit = text.add(token, done=req.is_finished,
                                           defer=not self._deltas)
            except Exception as e:   # text work fails one request, not the step
                self._text_failed(outputs, req, e)
                continue
            stop_hit = stop_hit or grammar_done
            if stop_hit and not req.is_finished:
                self.scheduler.finish(req.request_id, FinishReason.STOP)
            # A stop string ends the text even when the same token also hit a length limit.
            reason = FinishReason.STOP if stop_hit else req.finish_reason
            if req.sampling_params.logprobs is not None:
                text.logprobs.append(logprob_dict(sampled, b, req.sampling_params.logprobs,
                                                  self._token_text))
            self._emit(outputs, req, [token], delta, reason)
        return outputs

    def _text_failed(self, outputs: list, req: Request, error: Exception) -> None:
        """Text work (detokenizing, stop strings, a grammar) failed for `req`: it alone
        fails, with what it emitted so far."""
        log.error("request %s failed after its tokens", req.request_id, exc_info=error)
        if not req.is_finished:
            self.scheduler.finish(req.request_id, FinishReason.ERROR)
        self._groups.emit(outputs, self._error_output(req, error), self._deltas)

    def _emit(self, outputs: list, req: Request, new_ids, delta: str, reason) -> None:
        """A row's output for this step (every step with deltas, else only its final one)."""
        if reason is not None or self._deltas:
            self._groups.emit(outputs, self._output(req, new_ids, delta, reason), self._deltas)
        if reason is not None:
            self._forget(req.request_id)

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's text and grammar state."""
        del self._text[request_id]
        self._grammars.forget(request_id)
        self._prompt_lp.pop(request_id, None)

    def _error_output(self, req: Request, error: Exception) -> RequestOutput:
        """The final output of a request that failed (its text as far as it was emitted)."""
        out = self._output(req, [], "", FinishReason.ERROR)
        out.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self._forget(req.request_id)
        return out

    def _output(self, req: Request, new_ids, delta, reason) -> RequestOutput:
        text = self._text[req.request_id]
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            # A copy only when final: copying every step would cost O(length) per row per step
            # (consumers of intermediate outputs read new_token_ids; see RequestOutput).
            token_ids=list(req.output_token_ids) if reason else req.output_token_ids,
            text=text.text, new_token_ids=new_ids,
            text_delta=delta, finish_reason=reason,
            logprobs=list(text.logprobs) if req.sampling_params.logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs(req.request_id), prompt=text.prompt,
            ttft_s=req.ttft_s, latency_s=req.latency_s,
            lora=None if req.lora is None else self.loras.name_of(req.lora))

    def _prompt_logprobs(self, request_id: str):
        """The request's prompt logprobs once all are in (prompt_logprobs.py), else None."""
        lp = self._prompt_lp.get(request_id)
        return lp.entries if lp is not None and lp.done else None
