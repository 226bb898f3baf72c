"""The roofline gauges (serve/metrics.py): a decode step's bytes and a prefill step's FLOPs
over the device time the engine measured (jaxinfer/device_clock.py), each step counted once,
nothing where the device time is unknown."""
import jax
import numpy as np
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.scheduler_output import ScheduledRow, SchedulerOutput
from serve.metrics import Metrics, StepObserver


@pytest.fixture(scope="module")
def engine():
    return Engine.from_model("tiny", EngineConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                  max_model_len=128, page_size=4,
                                                  dtype="float32"))


def _row(rid, start, n):
    return ScheduledRow(rid, tuple(range(1, n + 1)), start, np.arange(1, 9, dtype=np.int32),
                        True)


def _gauge(metrics, name):
    return metrics.registry.get_sample_value(name)


def test_decode_bytes_and_prefill_flops_per_device_second(engine):
    metrics = Metrics()
    observer = StepObserver(metrics, engine)
    cfg, kv = engine.model_config, engine.runner.kv
    # every weight once, the untied embedding only for the step's 2 rows
    embed = engine.runner.params["embed"]
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.runner.params))
    if not cfg.tie_word_embeddings:
        weights -= embed.nbytes - 2 * cfg.hidden_size * embed.dtype.itemsize
    per_token = kv.nbytes / (kv.num_pages * kv.page_size)

    decode = SchedulerOutput((_row("a", 9, 1), _row("b", 4, 1)))
    engine.last_device = (0.002, decode)
    observer._roofline()
    # every weight once; row a's K/V for positions 0..9, row b's for 0..4
    want = (weights + (10 + 5) * per_token) / 0.002
    assert _gauge(metrics, "jaxinfer_decode_hbm_bandwidth_bytes_per_second") == pytest.approx(want)
    assert _gauge(metrics, "jaxinfer_step_device_seconds_count") == 1

    prefill = SchedulerOutput((_row("c", 0, 3), _row("a", 10, 1)))
    engine.last_device = (0.004, prefill)
    observer._roofline()
    e, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = layers * (e * (q + 2 * k) + q * e + 3 * e * f) + layers * 2 * e + e  # + norms
    pairs = (1 + 2 + 3) + 11           # row c's causal 3 x 3, row a's 1 x 11
    flops = (2 * linear * 4 + 2 * cfg.vocab_size * e * 2
             + 4 * layers * cfg.num_heads * cfg.head_dim * pairs)
    assert _gauge(metrics, "jaxinfer_prefill_flops_per_second") == pytest.approx(flops / 0.004)

    observer._roofline()                              # the same step again: counted once
    engine.last_device = (0.001, SchedulerOutput(prefill.rows, verify=True))
    observer._roofline()                              # a verify step: timed, no gauge
    assert _gauge(metrics, "jaxinfer_prefill_flops_per_second") == pytest.approx(flops / 0.004)
    engine.last_device = (None, decode)               # device time unknown: no reading
    observer._roofline()
    assert _gauge(metrics, "jaxinfer_step_device_seconds_count") == 3
    assert _gauge(metrics, "jaxinfer_decode_hbm_bandwidth_bytes_per_second") == pytest.approx(want)


def test_tokens_per_second_over_the_window_and_the_thread_account(engine, monkeypatch):
    """jaxinfer_output_tokens_per_second counts the steps of the last 10 s only; the
    engine thread's seconds reach their counter as increments of its running totals."""
    from jaxinfer.request import RequestOutput
    from serve import metrics as metrics_module

    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    metrics = Metrics()
    observer = StepObserver(metrics, engine)

    def step(tokens, thread):
        out = RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[], text="",
                            new_token_ids=[7] * tokens)
        observer.after_step([out], 0, thread)

    step(30, {"step": 1.0, "idle": 0.5})
    now[0] += 4
    step(10, {"step": 1.5, "idle": 0.5})
    assert _gauge(metrics, "jaxinfer_output_tokens_per_second") == pytest.approx(40 / 4)
    now[0] += 8                                   # the first step left the window
    step(20, {"step": 2.5, "idle": 2.0})
    assert _gauge(metrics, "jaxinfer_output_tokens_per_second") == pytest.approx(30 / 8)
    for part, total in (("step", 2.5), ("idle", 2.0)):
        assert metrics.registry.get_sample_value(
            "jaxinfer_engine_thread_seconds_total", {"part": part}) == pytest.approx(total)


@pytest.mark.gpu
def test_on_the_gpu_the_gauge_reads_what_the_decode_suite_measures():
    """Llama-3-8B's shape (synthetic bf16 weights), 64 requests decoding after 500-token
    prompts under async scheduling: the gauge's median over the steps where all 64 decode is
    within 10% of the decode suite's bandwidth (the same step dispatched back to back, at the
    median context), and no reading is above the device's measured copy ceiling."""
    import statistics

    from bench import ceilings
    from bench.common import decode_input, pipelined_step_s
    from jaxinfer.request import SamplingParams
    from jaxinfer.roofline import weight_bytes

    engine = Engine.from_model("llama-3-8b", EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024))
    engine.warmup(progress=False, variants=("plain",))
    observer = StepObserver(Metrics(), engine)
    rng = np.random.default_rng(0)
    cfg = engine.model_config
    for _ in range(64):
        engine.add_request({"prompt_token_ids": rng.integers(0, cfg.vocab_size, 500).tolist()},
                           SamplingParams(max_tokens=96, temperature=0, ignore_eos=True))
    readings, contexts, seen = [], [], None
    while engine.has_unfinished_requests():
        observer.after_step(engine.step(), 0)
        last = engine.last_device
        if last is not seen and last[0] and last[1].num_tokens == last[1].num_rows == 64:
            seen = last
            readings.append(observer.decode_bytes(last[1]) / last[0])
            contexts.append(statistics.median(r.seq_len for r in last[1].rows))
    assert len(readings) >= 60, len(readings)
    gauge = statistics.median(readings)
    context = int(statistics.median(contexts))
    runner = engine.runner
    inp = runner.prepare(decode_input(cfg, engine.config, 64, context, rng))
    step_s = pipelined_step_s(runner, inp, reps=5)
    kv = runner.kv
    suite = (weight_bytes(runner.params, cfg, 64, engine.config.lm_head)
             + 64 * context * kv.nbytes / (kv.num_pages * kv.page_size)) / step_s
    copy = ceilings.measure(reps=5)["copy_TBps"] * 1e12
    print(f"gauge {gauge / 1e12:.3f} TB/s, decode suite {suite / 1e12:.3f} TB/s at context "
          f"{context}, copy ceiling {copy / 1e12:.3f} TB/s, {len(readings)} readings")
    assert abs(gauge / suite - 1) <= 0.10, (gauge, suite)
    assert max(readings) <= copy, (max(readings), copy)
