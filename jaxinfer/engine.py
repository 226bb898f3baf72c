"""The engine: four hops per step (DESIGN.md) — schedule, prepare, run, update.

    out    = scheduler.schedule()                 which requests, how many tokens each
    arrays = batch.prepare(out, bucket, S)        numpy, padded to one bucket
    y      = runner.submit(build_step_input(...)) ONE jitted call, KV donated; scheduler.commit
    self._finish(step)                            tokens in (scheduler.resolve), text out

Only this class touches both sides. Text (detokenization, stop strings) lives here because
the scheduler sees token ids only.

Async scheduling (EngineConfig.async_scheduling): the host prepares step t+1 while step t
runs on the device. A step is committed to the scheduler as soon as it is dispatched (its
sampled tokens PENDING); the next step is scheduled and dispatched at once, its decode rows
taking their input token from step t's device output; then step t's tokens are fetched and
resolved (text, stop strings, finishing). So `step()` returns the outputs of the step before
the one it dispatched. A request that turns out to be finished at t wastes its row in t+1;
steps whose running requests use penalties wait for the previous step's tokens first (the
penalty window needs the last token), and leave its text work until they are dispatched.
Grammar rows need the last token only for their token bitmask, which the sampling reads, not
the forward pass: such a step is split (runner.submit_forward): its forward pass is
dispatched, then step t's tokens are read and accepted, the masks filled, and its sampling
dispatched, while the forward pass runs.

Speculative decoding (EngineConfig.num_speculative_tokens, speculative.py): while every
running request is in decode, none waits and there are at most speculative_rows of them, the
step in flight is read first, the proposer guesses each request's next tokens and the step
verifies them (a verify bucket); it is read at once, since what it keeps decides the next.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import time

import jax
from tqdm import tqdm

from jaxinfer import batch, compile_cache
from jaxinfer.buckets import Buckets
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.device_clock import DeviceClock
from jaxinfer.dispatch_thread import Pending
from jaxinfer.errors import ConfigError, EngineDeadError
from jaxinfer.engine_io import Detokenized, build_step_input, pending_source, token_bitmask
from jaxinfer.loading import load_model
from jaxinfer.engine_lora import EngineLoRA
from jaxinfer.engine_outputs import EngineOutputs
from jaxinfer.engine_requests import EngineRequests
from jaxinfer.engine_spec import EngineSpeculation
from jaxinfer.engine_warmup import EngineWarmup
from jaxinfer.lora import LoRARegistry
from jaxinfer.prompt_logprobs import PromptLogprobs, step_targets
from jaxinfer.request import RequestOutput
from jaxinfer.request_group import RequestGroups
from jaxinfer.routes import Routes
from jaxinfer.runner import CompileCounter, ModelRunner
from jaxinfer.scheduler import Scheduler
from jaxinfer.scheduler_output import SchedulerOutput
from jaxinfer.step_program import splits_host
from jaxinfer.structured_output import RequestGrammars


log = logging.getLogger("jaxinfer.engine")


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose sampled tokens the host has not read yet."""

    out: SchedulerOutput
    sampled: object        # SampleOutput on the device
    next_tokens: object    # [max_num_seqs] i32 on the device: its tokens, for the next step
    row_of: dict           # request id -> row index in this step
    # Some row of it uses a repetition/presence/frequency penalty or a grammar: the next
    # step needs its tokens first.
    waits: bool = False
    # the host finished dispatching it (device_clock.py; Pending while the dispatch thread has it)
    enqueued: float | Pending | None = None
    # Greedy without logprobs (the `plain` variant), not a verify step: the host reads only
    # its tokens, not the logprob outputs, which no row asked for.
    tokens_only: bool = False


class Engine(EngineRequests, EngineLoRA, EngineSpeculation, EngineOutputs, EngineWarmup):
    def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, graphdef, params,
                 tokenizer=None, *, model_name: str | None = None, routes: Routes | None = None,
                 draft_model=None):
        """routes: the kernels' routes (tests compare them); None chooses them from
        engine_cfg and the backend (routes.Routes.choose). draft_model: (ModelConfig,
        graphdef, params) of the model that drafts with speculative_method "draft"; None
        loads engine_cfg.speculative_model."""
        engine_cfg = engine_cfg.for_backend(jax.default_backend())
        compile_cache.enable(engine_cfg.compile_cache)
        if engine_cfg.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len {engine_cfg.max_model_len} exceeds the model's "
                              f"context length {cfg.max_position_embeddings}")
        self.model_config, self.config = cfg, engine_cfg
        self.model_name = model_name or cfg.name
        self.tokenizer = tokenizer
        self._token_text = None if tokenizer is None else tokenizer.token_text  # Logprob text
        self.runner = ModelRunner(cfg, engine_cfg, graphdef, params, routes)
        eos = set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
        self.scheduler = Scheduler.from_config(engine_cfg, eos_token_ids=sorted(eos))
        self.buckets = Buckets.from_config(engine_cfg)
        self.scheduler.token_shapes = tuple(self.buckets.mixed_sizes)
        self._text: dict[str, Detokenized] = {}
        self._groups = RequestGroups()     # n > 1 requests and their completions
        self._grammars = RequestGrammars(tokenizer, cfg.vocab_size)  # structured output
        self._prompt_lp: dict[str, PromptLogprobs] = {}   # requests asking for prompt logprobs
        self.loras = (LoRARegistry(cfg, engine_cfg.max_lora_rank,
                                   engine_cfg.max_cpu_loras or engine_cfg.max_loras)
                      if engine_cfg.max_loras else None)
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated = 0   # output tokens produced so far (all requests)
        self.last_step_s = 0.0
        self.last_host_s = 0.0
        self.last_phases: dict[str, float] = {}
        # (device seconds, SchedulerOutput) of the last step whose outputs were read, the
        # seconds None where the host's timestamps cannot tell them (device_clock.py)
        self.last_device: tuple[float | None, SchedulerOutput] | None = None
        self._device_clock = DeviceClock()
        self._inflight: _InFlight | None = None
        self._later = None   # a read step's text work, left until the next is dispatched
        self._outputs: list[RequestOutput] = []   # the current step's, so far
        self._deltas = True                       # the current step's `deltas`
        self._blame = None   # the SchedulerOutput of the step being dispatched or read
        self._waited = 0.0   # seconds the current step() spent waiting for tokens
        self._on_wait = None  # step()'s on_wait until it is called
        self._hooked = 0.0    # seconds the current step() spent in it
        self._no_prev = self.runner.no_prev
        self._page_tables = batch.PageTables()    # each step's from the last one's
        if jax.process_count() > 1:
            self._lead_followers()
        self._init_speculation(cfg, draft_model)

    @classmethod
    def from_model(cls, model: str, engine_cfg: EngineConfig, loras=()) -> "Engine":
        """The engine of `model` (any source load_model takes), serving the LoRA adapters
        `loras` ((name, PEFT directory) pairs) from the start."""
        compile_cache.enable(engine_cfg.compile_cache)    # loading compiles too
        cfg, graphdef, params, tokenizer = load_model(model, engine_cfg)
        engine = cls(cfg, engine_cfg, graphdef, params, tokenizer, model_name=str(model))
        for name, path in loras:
            engine.load_lora(name, path)
        return engine

    def _lead_followers(self) -> None:
        """Several processes (multihost.py): this engine leads; the others follow."""
        from jaxinfer.multihost import RunnerMirror
        if jax.process_index() != 0:
            raise ConfigError(f"the engine runs on process 0 only; process "
                              f"{jax.process_index()} follows it (multihost.follow)")
        for flag, on in (("max_loras", self.config.max_loras),
                         ("num_speculative_tokens", self.config.num_speculative_tokens)):
            if on:
                raise ConfigError(f"{flag} is not supported across several processes yet")
        self.runner.mirror = RunnerMirror()
        atexit.register(self.release_followers)   # the followers end with this process

    def release_followers(self) -> None:
        """Several processes: let the followers' `multihost.follow` return (the engine
        dispatches nothing after this)."""
        if self.runner.mirror is not None:
            self.runner.mirror.stop()
            self.runner.mirror = None

    # --- requests (add_request, encode_prompt, abort_request: engine_requests.py) -------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    @property
    def inflight(self) -> SchedulerOutput | None:
        """The step dispatched and not yet resolved (async scheduling): the next step()
        waits for its tokens."""
        return None if self._inflight is None else self._inflight.out

    # --- the step -----------------------------------------------------------------------
    def step(self, deltas: bool = True, on_wait=None) -> list[RequestOutput]:
        """Schedule and dispatch one step; return the outputs of the step that completed
        (this one, or with async scheduling the one before). `deltas=False`: only finished
        requests' (final) outputs, for callers that read nothing else (LLM.generate, the
        offline script): no per-row output objects, and text is decoded once at the end
        where no stop string needs it earlier.

        A step that raises (an XLA runtime error, out of memory, a bug) fails exactly the
        requests it ran: they come back as final outputs with FinishReason.ERROR and
        `error`; their pages are freed, a KV cache the failed step consumed is rebuilt, and
        every other request is recomputed from its known tokens, so nothing else is lost.
        EngineDeadError: the recovery itself failed (the engine is unusable).

        on_wait(): called once, when the step first waits for the device (then the host has
        nothing else to do), else as it ends; a caller's work that may wait (handing out the
        previous step's outputs) costs the step nothing there. Its seconds count in neither
        `last_step_s` nor `last_host_s`; it must not raise."""
        self._outputs = []
        self._blame = None
        self._deltas = deltas
        self._on_wait, self._hooked = on_wait, 0.0
        try:
            self._step()
        except Exception as e:
            self._outputs += self._take_later()   # the tokens taken before the failure
            self._recover(e)
        finally:
            self._wait_hook()
        return self._outputs

    def _wait_hook(self) -> None:
        """step()'s on_wait, the first time the step is about to wait (see `step`)."""
        hook, self._on_wait = self._on_wait, None
        if hook is not None:
            t = time.perf_counter()
            hook()
            self._hooked = time.perf_counter() - t
            self._waited += self._hooked   # not the host's work

    def _step(self) -> None:
        clock = time.perf_counter
        t0 = clock()
        busy = self.runner.dispatch_thread_seconds
        compiles = CompileCounter.count()
        self._waited = 0.0
        first = self._inflight
        prev, later, defer = self._read_early(first)
        t1 = clock()
        waited_early = self._waited
        self._blame = None     # a failure in the scheduler: every running request
        out = self.scheduler.schedule(self._drafts() if prev is None else None)
        if self.loras is not None:
            out = self._load_lora_slots(out)
        if out.verify and getattr(self.proposer, "on_device", False):
            out = self._draft_on_device(out)
        t2 = clock()
        m = dict.fromkeys(("ta", "tb", "t3", "tc", "t4", "t5"), t2) | {"masks": 0.0, "wall": 0.0}
        new = None
        if not out.is_empty:
            prev, later, new = self._dispatch(out, prev, later, defer, m)
        waited_before = self._waited     # the early read's and the sync's
        self._read_late(out, prev, later, new)
        t6 = clock()
        self.last_step_s = t6 - t0 - self._hooked
        self.last_host_s = t6 - t0 - self._waited
        # The step this one waited for (async: the one before) took this step's time; one
        # that compiled tells nothing of the next.
        if CompileCounter.count() == compiles:
            self.scheduler.deadlines.observe_step(out if first is None else first.out,
                                                  self.last_step_s)
        # Where the host's time went (seconds): the bench reports their medians.
        self.last_phases = {"early_resolve": t1 - t0 - waited_early, "schedule": t2 - t1,
                            "prepare": m["t3"] - t2, "prepare_arrays": m["ta"] - t2,
                            "prepare_input": m["tb"] - m["ta"],
                            "prepare_transfer": m["t3"] - m["tb"], "sync": m["tc"] - m["t3"],
                            "dispatch": m["t4"] - m["tc"],
                            "commit": m["t5"] - m["t4"] - m["wall"], "masks": m["masks"],
                            "resolve": t6 - m["t5"] - (self._waited - waited_before),
                            "wait": self._waited - self._hooked,
                            # beside these, on the dispatch thread (dispatch_thread.py)
                            "dispatch_thread": self.runner.dispatch_thread_seconds - busy}

    def _dispatch(self, out: SchedulerOutput, prev, later, defer: bool, m: dict):
        """Build `out`'s step input and submit it (with a grammar's token masks: after step t's
        tokens reach the grammars, in one step or split in two); commit it. Returns (prev,
        later, the new _InFlight): a step that needs masks finishes `prev` itself (None
        then). Times the phases into `m` (clock marks, and masks seconds)."""
        clock = time.perf_counter
        self._blame = out
        bucket = (self.buckets.choose_verify if out.verify else self.buckets.choose)(
            out.num_tokens, out.num_rows, out.max_pages)
        arrays = batch.prepare(out, bucket, self.config.page_size, self._page_tables)
        m["ta"] = clock()
        sources = pending_source(None if prev is None else prev.row_of,
                                 None if prev is None else prev.next_tokens,
                                 self._no_prev, out, arrays)
        vocab = self.model_config.vocab_size
        step_input = build_step_input(
            arrays, out, self.scheduler, *sources, vocab,
            None if defer else self._grammars.matchers,
            step_targets(out, len(arrays.tokens), self._prompt_lp) if self._prompt_lp
            else None)
        split = defer and splits_host(step_input)
        if defer and not split:    # the masks first, then the whole step
            later = self._finish(prev, text_later=True)
            prev = self._inflight = None
            self._blame = out
            step_input = dataclasses.replace(step_input, token_bitmask=token_bitmask(
                arrays, self._grammars.matchers, vocab))
        m["tb"] = clock()
        # Packed and moved to the device here, or on the dispatch thread with the dispatch.
        inp = (step_input if self.runner.dispatches_on_thread and not split
               else self.runner.prepare(step_input))
        m["t3"] = m["tc"] = clock()
        if prev is not None and not split:   # its dispatch may still be running
            self._blame = prev.out           # (dispatch_thread.py)
            self.runner.sync()
            self._blame = out
            m["tc"] = clock()
            self._waited += m["tc"] - m["t3"]
        if split:
            forward = self.runner.submit_forward(inp)
        else:
            sampled, next_tokens = self.runner.submit(inp)
        m["t4"] = enqueued = clock()
        self.scheduler.commit(out)
        copies = self.scheduler.take_copies()    # n > 1: the forks' copy-on-write
        if copies:
            self.runner.copy_pages(copies)
        if split:
            # Step t's tokens into the grammars, then this step's masks and sampling.
            tm, waited = clock(), self._waited
            later = self._finish(prev, text_later=True)
            prev = self._inflight = None
            self._blame = out
            sampled, next_tokens = self.runner.submit_sample(
                forward, token_bitmask(arrays, self._grammars.matchers, vocab))
            enqueued = clock()
            m["wall"] = clock() - tm
            m["masks"] = m["wall"] - (self._waited - waited)
        samp = step_input.sampling
        if isinstance(sampled, Pending):     # the dispatch thread enqueues it, later
            enqueued = self.runner.last_enqueued
        new = self._inflight = _InFlight(
            out, sampled, next_tokens, dict(zip(arrays.request_ids, range(out.num_rows))),
            waits=bool((samp.repetition_penalty != 1).any()
                       or samp.presence_penalty.any() or samp.frequency_penalty.any()
                       or self._grammars.any_of(arrays.request_ids)), enqueued=enqueued,
            tokens_only=not samp.full and not out.verify)
        self.num_steps += 1
        m["t5"] = clock()
        return prev, later, new

    def _recover(self, error: Exception) -> None:
        """After a failed step: its requests fail, the rest start over (see `step`). Across
        processes nothing is recovered: a failed step most likely lost a process, and the
        others cannot go on without it."""
        if self.runner.mirror is not None:
            raise EngineDeadError(f"a step failed in a job of {jax.process_count()} processes, "
                                  f"which cannot recover it: {error!r}") from error
        blamed = self._blame
        failed = ([r.request_id for r in blamed.rows] if blamed is not None
                  else [r.request_id for r in self.scheduler.running])
        log.error("engine step %d failed; failing its %d requests", self.num_steps,
                  len(failed), exc_info=error)
        try:
            self._inflight = None        # steps in flight are dropped, their tokens unseen
            self._device_clock.reset()
            lost = self.runner.kv_lost()
            if lost:
                self.runner.rebuild_kv()
            if self.draft_model is not None and self.draft_model.kv_lost():
                self.draft_model.rebuild_kv()   # every request's draft K/V is recomputed
            for req in self.scheduler.recover(failed, cache_lost=lost):
                self._groups.emit(self._outputs, self._error_output(req, error), self._deltas)
        except Exception as e:
            raise EngineDeadError(f"the engine could not recover from a failed step "
                                  f"({error!r}): {e}") from e

    # --- driving ------------------------------------------------------------------------
    def run_until_done(self, use_tqdm: bool = True) -> dict[str, RequestOutput]:
        """Step until no request is left; returns each request's final output by id."""
        final: dict[str, RequestOutput] = {}
        total = self._groups.count_requests(self.scheduler.requests)
        with tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for o in self.step(deltas=False):
                    if o.finished:
                        final[o.request_id] = o
                        bar.update(1)
        return final

    def stats(self) -> dict:
        s = dict(self.scheduler.stats())
        s.update(compiles=CompileCounter.count(), steps=self.num_steps,
                 padding_fraction=self.buckets.padding_fraction)
        if self.spec_stats is not None:
            s["speculative"] = self.spec_stats.as_dict()
        return s
