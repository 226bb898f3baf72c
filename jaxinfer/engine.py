"""The engine: four hops per step (DESIGN.md) — schedule, prepare, run, update.

    out    = scheduler.schedule()                 which requests, how many tokens each
    arrays = batch.prepare(out, bucket, S)        numpy, padded to one bucket
    y      = runner.step(build_step_input(...))   ONE jitted call, KV donated
    return self._update(out, y)                   tokens in, text out, finished requests freed

Only this class touches both sides. Text (detokenization, stop strings) lives here because
the scheduler sees token ids only.
"""
from __future__ import annotations

import itertools
import time

from tqdm import tqdm

from jaxinfer import batch
from jaxinfer.buckets import Buckets
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.engine_io import (Detokenized, build_step_input, check_params_for_model,
                                logprob_dict, prompt_token_ids)
from jaxinfer.request import FinishReason, Request, RequestOutput, SamplingParams
from jaxinfer.runner import CompileCounter, ModelRunner
from jaxinfer.scheduler import Scheduler, SchedulerOutput


class Engine:
    def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, graphdef, params,
                 tokenizer=None, *, model_name: str | None = None):
        if engine_cfg.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len {engine_cfg.max_model_len} exceeds the model's "
                              f"context length {cfg.max_position_embeddings}")
        self.model_config, self.config = cfg, engine_cfg
        self.model_name = model_name or cfg.name
        self.tokenizer = tokenizer
        self.runner = ModelRunner(cfg, engine_cfg, graphdef, params)
        eos = set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.scheduler = Scheduler.from_config(engine_cfg, eos_token_ids=sorted(eos))
        self.buckets = Buckets.from_config(engine_cfg)
        self._text: dict[str, Detokenized] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_step_s = 0.0
        self.last_host_s = 0.0

    @classmethod
    def from_model(cls, model: str, engine_cfg: EngineConfig) -> "Engine":
        from jaxinfer.loading import load_model

        cfg, graphdef, params, tokenizer = load_model(model, engine_cfg)
        return cls(cfg, engine_cfg, graphdef, params, tokenizer, model_name=str(model))

    # --- requests -----------------------------------------------------------------------
    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text, chat messages, or {"prompt_token_ids": [...]}); returns its id."""
        params = sampling_params or SamplingParams()
        check_params_for_model(params, self.tokenizer, self.model_config.vocab_size)
        ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.scheduler.add(Request(rid, ids, params))
        self._text[rid] = Detokenized(self.tokenizer, ids, params,
                                      prompt if isinstance(prompt, str) else None)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its pages are free for the next step. Unknown ids are ignored."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        out = self._output(req, [], self._text[request_id].finish(), FinishReason.CANCELLED)
        del self._text[request_id]
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        bucket = self.buckets.choose(out.num_tokens, out.num_rows, out.max_pages)
        arrays = batch.prepare(out, bucket, self.config.page_size)
        inp = build_step_input(arrays, out, self.scheduler)
        t1 = time.perf_counter()
        sampled = self.runner.step(inp)
        t2 = time.perf_counter()
        outputs = self._update(out, sampled)
        self.num_steps += 1
        self.last_step_s = time.perf_counter() - t0
        self.last_host_s = self.last_step_s - (t2 - t1)
        return outputs

    def _update(self, out: SchedulerOutput, sampled) -> list[RequestOutput]:
        tokens = [int(t) for t in sampled.tokens[:out.num_rows]]
        got_token = {r.request_id: r for r in self.scheduler.update(out, tokens)}
        outputs = []
        for b, row in enumerate(out.rows):
            req = got_token.get(row.request_id)
            if req is None:
                continue
            text = self._text[req.request_id]
            delta, stop_hit = text.add(tokens[b], done=req.is_finished)
            if stop_hit and not req.is_finished:
                self.scheduler.finish(req.request_id, FinishReason.STOP)
            # A stop string ends the text even when the same token also hit a length limit.
            reason = FinishReason.STOP if stop_hit else req.finish_reason
            if req.sampling_params.logprobs is not None:
                text.logprobs.append(logprob_dict(sampled, b, req.sampling_params.logprobs))
            outputs.append(self._output(req, [tokens[b]], delta, reason))
            if reason is not None:
                del self._text[req.request_id]
        return outputs

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
            prompt=text.prompt, ttft_s=req.ttft_s, latency_s=req.latency_s)

    # --- driving ------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> dict:
        """Compile every bucket ahead of time; returns {'compiles', 'seconds', 'buckets'}."""
        t0, c0 = time.perf_counter(), CompileCounter.count()
        buckets = self.buckets.all_buckets()
        with tqdm(total=2 * len(buckets), desc="compiling buckets (x2 sampling variants)",
                  disable=not progress, unit="step") as bar:
            self.runner.warmup(buckets, on_done=lambda: bar.update(1))
        return {"compiles": CompileCounter.count() - c0,
                "seconds": time.perf_counter() - t0,
                "buckets": len(self.buckets.all_buckets())}

    def run_until_done(self, use_tqdm: bool = True) -> dict[str, RequestOutput]:
        """Step until no request is left; returns each request's final output by id."""
        final: dict[str, RequestOutput] = {}
        total = len(self.scheduler.requests)
        with tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.scheduler.has_unfinished:
                for o in self.step():
                    if o.finished:
                        final[o.request_id] = o
                        bar.update(1)
        return final

    def stats(self) -> dict:
        s = dict(self.scheduler.stats())
        s.update(compiles=CompileCounter.count(), steps=self.num_steps,
                 padding_fraction=self.buckets.padding_fraction)
        return s
