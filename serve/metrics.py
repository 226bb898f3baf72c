"""Prometheus metrics of the server, on their own registry (exported over HTTP by `serve()`).

Per-request latencies are observed by the gRPC handlers; everything about steps and the KV
cache by the engine thread after each step. The decode HBM bandwidth is the bytes a decode
step must move (every weight once, the K/V of every context token read, one token's K/V
written per row) over the step's device time: unlike "GPU utilization" it says how close a
decode step runs to the memory roofline; the prefill gauge is the same for a step with prompt
tokens, in FLOPs. The device time is the engine's measurement (jaxinfer/device_clock.py):
steps whose device time the host cannot tell (it never waited for them) leave the gauges as
they were.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxinfer.roofline import step_flops, weight_bytes

_LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .075, .1, .15, .25, .5, .75, 1, 2.5, 5,
                    10, 30, 60)
_TOKENS_PER_S_WINDOW_S = 10.0


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()

        def hist(name, doc):
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.ttft = hist("jaxinfer_ttft_seconds", "Arrival at the server to the first token")
        self.itl = hist("jaxinfer_inter_token_latency_seconds", "Time between streamed tokens")
        self.e2e = hist("jaxinfer_e2e_latency_seconds", "Arrival to the last token")
        self.queue = hist("jaxinfer_queue_time_seconds", "Arrival to the first step that runs it")
        self.step_time = hist("jaxinfer_step_seconds", "Wall time of one engine step")
        self.host_time = hist("jaxinfer_step_host_seconds",
                              "The host's part of one engine step: its wall time less its "
                              "waits on the device")
        self.thread_time = Counter("jaxinfer_engine_thread_seconds",
                                   "The engine thread's time by part: idle (nothing to run), "
                                   "commands (adding and aborting requests), step "
                                   "(Engine.step), deliver (outputs to the request handlers), "
                                   "observe (these metrics)", ["part"], registry=r)
        self.running = Gauge("jaxinfer_requests_running", "Requests holding KV pages", registry=r)
        self.waiting = Gauge("jaxinfer_requests_waiting", "Requests not yet scheduled", registry=r)
        self.pages_used = Gauge("jaxinfer_kv_pages_used", "KV pages held by requests", registry=r)
        self.pages_total = Gauge("jaxinfer_kv_pages_usable", "KV pages in the pool", registry=r)
        self.hit_rate = Gauge("jaxinfer_prefix_cache_hit_rate",
                              "Prompt tokens served from the prefix cache / prompt tokens",
                              registry=r)
        self.preemptions = Counter("jaxinfer_preemptions", "Requests preempted", registry=r)
        self.compiles = Counter("jaxinfer_compiles", "XLA compilations of the step", registry=r)
        self.output_tokens = Counter("jaxinfer_output_tokens", "Tokens generated", registry=r)
        self.step_tokens = Counter("jaxinfer_step_tokens", "Tokens the steps computed",
                                   registry=r)
        self.bucket_tokens = Counter("jaxinfer_step_bucket_tokens",
                                     "Tokens of the compiled shapes those steps ran in "
                                     "(computed + padding)", registry=r)
        self.tokens_per_s = Gauge("jaxinfer_output_tokens_per_second",
                                  f"Tokens generated over the last {_TOKENS_PER_S_WINDOW_S:.0f} s",
                                  registry=r)
        self.hbm_bw = Gauge("jaxinfer_decode_hbm_bandwidth_bytes_per_second",
                            "Bytes the last measured decode step had to move (weights, its "
                            "rows' K/V) / its device time", registry=r)
        self.prefill_flops = Gauge("jaxinfer_prefill_flops_per_second",
                                   "FLOPs of the last measured step with prompt tokens / its "
                                   "device time", registry=r)
        self.device_time = hist("jaxinfer_step_device_seconds",
                                "Device time of one engine step (steps the host can time)")
        self.requests = Counter("jaxinfer_requests", "Finished requests by outcome",
                                ["outcome"], registry=r)
        self.refused = Counter("jaxinfer_requests_refused",
                               "Requests refused before they ran, by reason (queue_full, "
                               "deadline, loading, draining, failed)", ["reason"], registry=r)
        self.lora_requests = Counter("jaxinfer_lora_requests",
                                     "Finished requests per LoRA adapter", ["adapter"],
                                     registry=r)
        self.lora_tokens = Counter("jaxinfer_lora_output_tokens",
                                   "Tokens generated per LoRA adapter", ["adapter"], registry=r)
        self.loras_loaded = Gauge("jaxinfer_lora_adapters_loaded", "LoRA adapters loaded",
                                  registry=r)
        # Speculative decoding (vLLM's spec_decode counters): a draft is one row's proposal
        # in one step.
        self.spec_drafts = Counter("jaxinfer_spec_decode_num_drafts",
                                   "Speculative proposals verified (one per row and step)",
                                   registry=r)
        self.spec_draft_tokens = Counter("jaxinfer_spec_decode_num_draft_tokens",
                                         "Tokens proposed", registry=r)
        self.spec_accepted = Counter("jaxinfer_spec_decode_num_accepted_tokens",
                                     "Proposed tokens kept", registry=r)
        self.spec_accepted_per_pos = Counter(
            "jaxinfer_spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens kept, by their position in the proposal (0 = first)",
            ["position"], registry=r)


class StepObserver:
    """Engine-thread side: reads the engine after each step (only that thread may)."""

    def __init__(self, metrics: Metrics, engine):
        self.m, self.engine, self._compiles = metrics, engine, engine.compiles
        self._weight_bytes = functools.lru_cache(maxsize=None)(functools.partial(
            weight_bytes, engine.runner.params, engine.model_config,
            lm_head=engine.config.lm_head))        # rows -> bytes (roofline.py)
        kv = engine.runner.kv
        self._kv_bytes_per_token = kv.nbytes / (kv.num_pages * kv.page_size)
        self._last_device = None     # the engine's last_device already counted
        metrics.pages_total.set(engine.scheduler.allocator.num_usable)
        self._recent = collections.deque()  # (time, tokens) of the steps in the window
        self._recent_tokens = 0             # their tokens
        self._last_preemptions = self._last_compiles = 0  # totals already counted
        self._last_real = self._last_padded = 0
        self._last_spec = None       # speculative.SpecStats totals already counted
        self._last_thread: dict[str, float] = {}   # the engine thread's seconds counted
        self._thread_counters: dict = {}           # part -> its labelled counter
        self._count(metrics.compiles, self._compiles(), "_last_compiles")  # the warmup's

    def gauges(self, num_waiting: int) -> None:
        """Refresh the request and KV gauges (also after aborts, when no step follows)."""
        m, s = self.m, self.engine.scheduler.stats()
        m.running.set(s["num_running"])
        m.waiting.set(num_waiting)
        m.pages_used.set(s["kv_pages_used"])
        m.hit_rate.set(s["prefix_cache_hit_rate"])
        self._count(m.preemptions, s["num_preemptions"], "_last_preemptions")

    def after_step(self, outputs, num_waiting: int, thread_seconds=None) -> None:
        """After each step: `outputs` its outputs, `thread_seconds` the engine thread's
        time account (EngineThread.seconds) or None."""
        m = self.m
        if thread_seconds is not None:
            last, counters = self._last_thread, self._thread_counters
            for part, total in thread_seconds.items():
                counter = counters.get(part) or counters.setdefault(
                    part, m.thread_time.labels(part))
                counter.inc(total - last.get(part, 0.0))
                last[part] = total
        m.step_time.observe(self.engine.last_step_s)
        m.host_time.observe(self.engine.last_host_s)
        self.gauges(num_waiting)
        self._count(m.compiles, self._compiles(), "_last_compiles")
        buckets = self.engine.buckets
        self._count(m.step_tokens, buckets.real_tokens, "_last_real")
        self._count(m.bucket_tokens, buckets.padded_tokens, "_last_padded")
        tokens = sum(len(o.new_token_ids) for o in outputs)   # several a row when speculating
        m.output_tokens.inc(tokens)
        self._tokens_per_s(tokens)
        self._per_adapter(outputs)
        self._speculation()
        self._roofline()

    def _roofline(self) -> None:
        """The gauges of the step the engine last timed on the device (device_clock.py):
        a decode step's bytes (every row one token) or a step with prompt tokens' FLOPs, per
        device second. Each step is counted once."""
        last = self.engine.last_device
        if last is None or last is self._last_device:
            return
        self._last_device = last
        seconds, out = last
        if not seconds or out.is_empty:
            return
        self.m.device_time.observe(seconds)
        if out.num_tokens == out.num_rows:
            self.m.hbm_bw.set(self.decode_bytes(out) / seconds)
        elif not out.verify:     # a speculative verify step is neither
            self.m.prefill_flops.set(self.step_flops(out) / seconds)

    def _per_adapter(self, outputs) -> None:
        if not self.engine.config.max_loras:     # no adapters: nothing to count per step
            return
        m = self.m
        m.loras_loaded.set(len(self.engine.lora_names()))
        for o in outputs:
            if o.lora is not None:
                m.lora_tokens.labels(o.lora).inc(len(o.new_token_ids))
                if o.finished:
                    m.lora_requests.labels(o.lora).inc()

    def _speculation(self) -> None:
        now = self.engine.spec_stats
        if now is None:
            return
        m, was = self.m, self._last_spec or type(now)(now.k)
        m.spec_drafts.inc(now.num_drafts - was.num_drafts)
        m.spec_draft_tokens.inc(now.num_draft_tokens - was.num_draft_tokens)
        m.spec_accepted.inc(now.num_accepted_tokens - was.num_accepted_tokens)
        for j, (a, b) in enumerate(zip(now.accepted_per_pos, was.accepted_per_pos)):
            if a > b:
                m.spec_accepted_per_pos.labels(str(j)).inc(a - b)
        self._last_spec = dataclasses.replace(now, accepted_per_pos=list(now.accepted_per_pos))

    def queue_time(self, seconds: float) -> None:
        self.m.queue.observe(seconds)

    def decode_bytes(self, out) -> float:
        """The bytes a decode step (SchedulerOutput `out`) must move: the weights it reads
        (roofline.weight_bytes: the embedding only for its rows) and each row's K/V up to and
        including its new token."""
        context = sum(row.seq_len for row in out.rows)
        return self._weight_bytes(out.num_rows) + context * self._kv_bytes_per_token

    def step_flops(self, out) -> float:
        """The FLOPs of a step (SchedulerOutput `out`; roofline.step_flops)."""
        return step_flops(self.engine.model_config,
                          [(r.start_pos, r.num_tokens) for r in out.rows])

    def _count(self, counter, total, attr):
        counter.inc(max(0, total - getattr(self, attr)))
        setattr(self, attr, total)

    def _tokens_per_s(self, n: int) -> None:
        now, recent = time.monotonic(), self._recent
        recent.append((now, n))
        self._recent_tokens += n
        while recent and recent[0][0] < now - _TOKENS_PER_S_WINDOW_S:
            self._recent_tokens -= recent.popleft()[1]
        span = max(now - recent[0][0], self.engine.last_step_s, 1e-9)
        self.m.tokens_per_s.set(self._recent_tokens / span)
