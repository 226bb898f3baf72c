"""Prometheus metrics of the server, on their own registry (exported over HTTP by `serve()`).

Per-request latencies are observed by the gRPC handlers; everything about steps and the KV
cache by the engine thread after each step. The decode HBM bandwidth is the bytes a decode
step must move (every weight once, the K/V of every context token read, one token's K/V
written per row) over the step's device time: unlike "GPU utilization" it says how close a
decode step runs to the memory roofline.
"""
from __future__ import annotations

import collections
import dataclasses
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.tokens_per_s = Gauge("jaxinfer_output_tokens_per_second",
                                  f"Tokens generated over the last {_TOKENS_PER_S_WINDOW_S:.0f} s",
                                  registry=r)
        self.hbm_bw = Gauge("jaxinfer_decode_hbm_bandwidth_bytes_per_second",
                            "Bytes the last decode step had to move / its device time",
                            registry=r)
        self.requests = Counter("jaxinfer_requests", "Finished requests by outcome",
                                ["outcome"], registry=r)
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
        import jax

        self.m, self.engine, self._compiles = metrics, engine, engine.compiles
        self._weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.runner.params))
        kv = engine.runner.kv
        self._kv_bytes_per_token = kv.nbytes / (kv.num_pages * kv.page_size)
        self._real_tokens = engine.buckets.real_tokens
        metrics.pages_total.set(engine.scheduler.allocator.num_usable)
        self._recent = collections.deque()  # (time, tokens) of the steps in the window
        self._last_preemptions = self._last_compiles = 0  # totals already counted
        self._last_spec = None       # speculative.SpecStats totals already counted
        self._count(metrics.compiles, self._compiles(), "_last_compiles")  # the warmup's

    def gauges(self, num_waiting: int) -> None:
        """Refresh the request and KV gauges (also after aborts, when no step follows)."""
        m, s = self.m, self.engine.scheduler.stats()
        m.running.set(s["num_running"])
        m.waiting.set(num_waiting)
        m.pages_used.set(s["kv_pages_used"])
        m.hit_rate.set(s["prefix_cache_hit_rate"])
        self._count(m.preemptions, s["num_preemptions"], "_last_preemptions")

    def after_step(self, outputs, num_waiting: int) -> None:
        m = self.m
        m.step_time.observe(self.engine.last_step_s)
        self.gauges(num_waiting)
        self._count(m.compiles, self._compiles(), "_last_compiles")
        tokens = sum(len(o.new_token_ids) for o in outputs)   # several a row when speculating
        m.output_tokens.inc(tokens)
        self._tokens_per_s(tokens)
        self._per_adapter(outputs)
        self._speculation()
        fed = self.engine.buckets.real_tokens - self._real_tokens
        self._real_tokens = self.engine.buckets.real_tokens
        device_s = self.engine.last_step_s - self.engine.last_host_s
        # Every row sampled one token and the step fed one token per row: a decode step.
        if outputs and fed == len(outputs) == tokens and device_s > 0:
            m.hbm_bw.set(self.decode_bytes(outputs) / device_s)

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

    def decode_bytes(self, outputs) -> float:
        context = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outputs)
        return self._weight_bytes + (context + len(outputs)) * self._kv_bytes_per_token

    def _count(self, counter, total, attr):
        counter.inc(max(0, total - getattr(self, attr)))
        setattr(self, attr, total)

    def _tokens_per_s(self, n: int) -> None:
        now, recent = time.monotonic(), self._recent
        recent.append((now, n))
        while recent and recent[0][0] < now - _TOKENS_PER_S_WINDOW_S:
            recent.popleft()
        span = max(now - recent[0][0], self.engine.last_step_s, 1e-9)
        self.m.tokens_per_s.set(sum(k for _, k in recent) / span)
