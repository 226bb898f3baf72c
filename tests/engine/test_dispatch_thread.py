"""Sampling steps dispatched from a thread of their own (jaxinfer/dispatch_thread.py; on by
default on the GPU, started by hand here): the engine returns while a dispatch still blocks,
prepares the next step meanwhile, and its outputs are those of the synchronous engine."""
import threading

import numpy as np

from engine_util import random_prompts, run_staggered, tiny_engine
from jaxinfer.request import SamplingParams
from jaxinfer.step_input import PackedInput


def _workload(n=10, seed=4):
    rng = np.random.default_rng(seed)
    params = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(2, 14)),
                               ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=12, logprobs=2,
                               stop_token_ids=(int(rng.integers(3, 40)),))
        elif kind == 2:   # a penalty: the next step waits for this one's tokens
            p = SamplingParams(temperature=0.8, seed=50 + i, max_tokens=9,
                               repetition_penalty=1.2, ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.0, max_tokens=8, n=2, ignore_eos=True)
        params.append(p)
    return random_prompts(n, lo=2, hi=30, seed=seed), params, sorted(
        rng.integers(0, 12, n).tolist())


def _threaded(**kw):
    engine = tiny_engine(async_scheduling=True, **kw)
    engine.runner.start_dispatch_thread()
    threads = set()
    dispatch = engine.runner.dispatch

    def spy(kv, inp, *a):   # (variant, thread) of each dispatch
        threads.add(("plain" if inp.bitmask is None else "full",
                     threading.current_thread().name.startswith("jaxinfer-dispatch")))
        return dispatch(kv, inp, *a)
    engine.runner.dispatch = spy
    prepare = engine.runner.prepare

    def packed(inp):     # (variant, thread) of each packing of a step's host input
        if not isinstance(inp, PackedInput):
            threads.add(("packed", threading.current_thread().name.startswith(
                "jaxinfer-dispatch")))
        return prepare(inp)
    engine.runner.prepare = packed
    return engine, threads


def _enqueue_times(engine) -> list:
    """The enqueue time the engine hands its device clock for each step it reads."""
    times, wait = [], engine._device_clock.wait

    def spy(outputs, enqueued):
        times.append(enqueued)
        return wait(outputs, enqueued)
    engine._device_clock.wait = spy
    return times


def test_outputs_equal_the_synchronous_engine():
    prompts, params, arrivals = _workload()
    engine, threads = _threaded()
    enqueued = _enqueue_times(engine)
    thread_s = []
    step = engine.step

    def timed_step(*a, **kw):
        try:
            return step(*a, **kw)
        finally:
            thread_s.append(engine.last_phases["dispatch_thread"])
    engine.step = timed_step
    got = run_staggered(engine, prompts, params, arrivals)
    want = run_staggered(tiny_engine(async_scheduling=False), prompts, params, arrivals)
    assert [(o.token_ids, o.finish_reason) for o in got] == [
        (o.token_ids, o.finish_reason) for o in want]
    for a, b in zip(got, want):
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys()
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
    # Every step packed, moved and dispatched on the thread, greedy ones (no conditional to
    # block on) too, and its time there counted; the device clock gets each one's enqueue
    # time from the thread, in step order.
    assert threads == {("plain", True), ("full", True), ("packed", True)}
    assert sum(thread_s) > 0 and all(t >= 0 for t in thread_s), thread_s
    assert enqueued and all(isinstance(t, float) for t in enqueued), enqueued
    assert enqueued == sorted(enqueued)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_usable and not engine.has_unfinished_requests()


def test_a_step_returns_while_its_dispatch_still_blocks():
    """The dispatch of step 1 is held on the thread: engine.step() returns anyway (a
    dispatch from the engine's thread would hang it), and the step after it waits."""
    engine, _ = _threaded()
    release, entered = threading.Event(), threading.Event()
    dispatch = engine.runner.dispatch

    def held(kv, inp, *a):
        entered.set()
        assert release.wait(60)
        return dispatch(kv, inp, *a)
    engine.runner.dispatch = held
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=4, ignore_eos=True)
    prompt = random_prompts(1, seed=8)[0]
    engine.add_request(prompt, params)
    assert engine.step() == []
    assert entered.wait(60) and not release.is_set()
    engine.runner.dispatch = dispatch
    release.set()
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    want = run_staggered(tiny_engine(async_scheduling=False), [prompt], [params], [0])[0]
    assert tokens == want.token_ids
