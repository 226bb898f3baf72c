"""The engine's speculative decoding (a mixin of Engine: it reads the engine's proposer,
scheduler and text state): when a step verifies proposals, what each row proposes, and a
verify step's kept tokens in, one at a time (speculative.py has the rule)."""
from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxinfer import speculative
from jaxinfer.config import ModelConfig
from jaxinfer.draft_model import DraftModel
from jaxinfer.errors import ConfigError
from jaxinfer.loading import load_model
from jaxinfer.engine_io import logprob_dict
from jaxinfer.request import FinishReason, RequestOutput
from jaxinfer.scheduler_output import SchedulerOutput


class EngineSpeculation:
    def _init_speculation(self, cfg: ModelConfig, draft_model=None) -> None:
        """The proposer (any speculative.Proposer may replace it), what it achieved, and
        the draft model of speculative_method "draft" (`draft_model`: its (ModelConfig,
        graphdef, params), None: load config.speculative_model); all None when
        num_speculative_tokens is 0."""
        config = self.config
        if (config.num_speculative_tokens and config.speculative_method == "self"
                and config.draft_layers(cfg.num_layers) > cfg.num_layers):
            raise ConfigError(f"speculative_draft_layers {config.speculative_draft_layers} "
                              f"exceeds the model's {cfg.num_layers} layers")
        self.proposer = speculative.make_proposer(config, cfg.num_layers)
        self.spec_stats = (speculative.SpecStats(config.num_speculative_tokens)
                           if self.proposer is not None else None)
        self.draft_model = None
        if isinstance(self.proposer, speculative.ModelDraft):
            if draft_model is None:
                draft_model = load_model(config.speculative_model,
                                         config.replace(num_speculative_tokens=0))[:3]
            self.draft_model = DraftModel(cfg, draft_model[0], config, *draft_model[1:])

    def _warm_drafts(self) -> None:
        """Compile the on-device drafting (the draft model's catch-up and draft programs, or
        self-speculation's draft program) for every verify size; nothing otherwise."""
        if self.draft_model is not None:
            self.draft_model.warmup(self.buckets.verify_sizes)
        else:
            self.runner.warmup_drafts(self.buckets.verify_sizes)

    def _may_speculate(self) -> bool:
        """The next step may verify proposals: speculation on, every running request in
        decode (its last token, possibly pending, the only one to feed) without a grammar,
        at most speculative_rows of them, and no waiting request a free row could admit."""
        if self.proposer is None:
            return False
        s = self.scheduler
        return ((not s.waiting or s.free_rows <= 0)
                and 0 < len(s.running) <= self.config.speculative_rows
                and all(r.num_uncomputed_tokens == 1 and r.request_id not in self._grammars
                        for r in s.running))

    def _drafts(self) -> dict[str, list[int]] | None:
        """The proposer's tokens for each running request (nothing pending): the next
        step's `drafts`; None when speculation is off now or nothing was proposed."""
        if not self._may_speculate():
            return None
        k = self.config.num_speculative_tokens
        drafts = {}
        for r in self.scheduler.running:
            proposal = self.proposer.propose(r.all_token_ids, k)
            if proposal:
                drafts[r.request_id] = list(proposal)[:k]
        return drafts or None

    def _draft_on_device(self, out: SchedulerOutput) -> SchedulerOutput:
        """A verify step whose proposals are drafted on the device (self-speculation, or a
        draft model after it caught up): the rows' reserved places filled with the draft
        program's tokens, padded to the verify bucket's rows (runner.draft)."""
        sizes, n = self.buckets.verify_sizes, out.num_rows
        b = sizes[bisect.bisect_left(sizes, n)]
        tokens, positions, seq_lens, lengths = (np.zeros(b, np.int32) for _ in range(4))
        table = np.zeros((b, self.config.pages_per_seq), np.int32)
        for i, row in enumerate(out.rows):
            tokens[i], positions[i] = row.token_ids[0], row.start_pos
            seq_lens[i], lengths[i] = row.start_pos + 1, row.num_tokens - 1
            table[i, :len(row.page_ids)] = row.page_ids
        lora, drafter = None, self.runner
        if self.draft_model is not None:
            self.draft_model.catch_up(self.scheduler.requests, out.rows)
            drafter = self.draft_model.runner
        elif self.loras is not None:
            slots = self.scheduler.lora_slots
            lora = np.full(b, -1, np.int32)
            for i, row in enumerate(out.rows):
                key = self.scheduler.requests[row.request_id].lora
                lora[i] = -1 if key is None else slots.slot(key)
        drafted = drafter.draft(tokens, positions, table, seq_lens, lengths, lora)
        return dataclasses.replace(out, rows=tuple(
            row._replace(token_ids=(row.token_ids[0],
                                    *map(int, drafted[i, :row.num_tokens - 1])))
            for i, row in enumerate(out.rows)))

    def _update_verify(self, out: SchedulerOutput, sampled) -> list[RequestOutput]:
        """A verify step's tokens in (speculative.py): each row keeps its sampled tokens up
        to the first that differs from its proposal, one at a time through the finishing
        rules and stop strings, so nothing after the end of a request is kept."""
        tokens, outputs, first = sampled.tokens, [], 0
        for row in out.rows:
            at, first = first, first + row.num_tokens
            req = self.scheduler.requests.get(row.request_id)
            if req is None:
                continue   # finished (or aborted) after this step was scheduled
            drawn = tokens[at:first]
            kept = speculative.accepted_count(drawn[:-1], row.token_ids[1:])
            self.spec_stats.record(row.num_tokens - 1, kept)
            if self.draft_model is not None:
                # Its pool holds the K/V of the fed tokens that were kept (and the last one).
                req.num_draft_computed = row.start_pos + min(kept, row.num_tokens - 2) + 1
            text, logprobs = self._text[req.request_id], req.sampling_params.logprobs
            new_ids, deltas, reason = [], [], None
            try:
                for j in range(kept + 1):
                    token = int(drawn[j])
                    done = self.scheduler.push_token(req, token, fed=j < kept)
                    delta, stop_hit = text.add(token, done=done, defer=not self._deltas)
                    new_ids.append(token)
                    deltas.append(delta)
                    if logprobs is not None:
                        text.logprobs.append(logprob_dict(sampled, at + j, logprobs,
                                                          self._token_text))
                    if stop_hit and not req.is_finished:
                        self.scheduler.finish(req.request_id, FinishReason.STOP)
                    if req.is_finished:
                        reason = FinishReason.STOP if stop_hit else req.finish_reason
                        break
            except Exception as e:   # text work fails one request, not the step
                self._text_failed(outputs, req, e)
                continue
            self.num_generated += len(new_ids)
            self.scheduler.settle(req)
            self._emit(outputs, req, new_ids, "".join(deltas), reason)
        return outputs
