"""Async scheduling (the host prepares step t+1 while step t runs) changes nothing a user sees:
the same tokens, finish reasons and logprobs as the synchronous engine, under EOS and stop
tokens that end requests a step early, penalties (which force a sync), seeded sampling,
preemption, prefix caching and aborts; and every page comes back."""
import numpy as np
import pytest

from engine_util import random_prompts, run_staggered, tiny_engine
from jaxinfer.request import FinishReason, SamplingParams
from jaxinfer.sampling import SampleOutput
from jaxinfer.step_input import unpack


def _workload(n=12, seed=3):
    rng = np.random.default_rng(seed)
    prompts = random_prompts(n, lo=2, hi=30, seed=seed)
    params = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 16)),
                               ignore_eos=True)
        elif kind == 1:   # ends on EOS (token 2) or a stop id when the model emits one
            p = SamplingParams(temperature=0.9, top_k=8, seed=int(rng.integers(1 << 30)),
                               max_tokens=20, stop_token_ids=(int(rng.integers(3, 40)),))
        elif kind == 2:
            p = SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=14, logprobs=2,
                               ignore_eos=True)
        elif kind == 3:   # penalties: the engine waits for the last token first
            p = SamplingParams(temperature=0.8, seed=100 + i, max_tokens=10,
                               repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True)
        elif kind == 4:
            p = SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=(7, 11, 13, 17))
        else:
            p = SamplingParams(temperature=1.0, min_p=0.05, seed=7 * i, max_tokens=12)
        params.append(p)
    arrivals = sorted(rng.integers(0, 25, n).tolist())
    return prompts, params, arrivals


def _summary(outs):
    return [(o.token_ids, o.finish_reason) for o in outs]


def _same_logprobs(a, b):
    """Logprobs agree to float32 noise: a preempted request recomputes its context with
    prefill kernels, and preemption happens at other steps in the two modes."""
    for x, y in zip(a, b):
        assert (x.logprobs is None) == (y.logprobs is None)
        for dx, dy in zip(x.logprobs or [], y.logprobs or []):
            assert dx.keys() == dy.keys()
            assert all(abs(dx[k].logprob - dy[k].logprob) < 1e-4 for k in dx)


@pytest.mark.parametrize("engine_kw", [
    {},
    {"num_pages": 20},                       # preemption
    {"max_num_batched_tokens": 7},           # small prefill chunks
    {"enable_prefix_caching": False},
])
def test_async_equals_sync(engine_kw):
    prompts, params, arrivals = _workload()
    shared = list(range(60, 75))  # a shared prefix for prefix-cache hits
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} if i % 2 else p
               for i, p in enumerate(prompts)]
    sync = tiny_engine(async_scheduling=False, **engine_kw)
    run_async = tiny_engine(async_scheduling=True, **engine_kw)
    want = run_staggered(sync, prompts, params, arrivals)
    got = run_staggered(run_async, prompts, params, arrivals)
    assert _summary(got) == _summary(want)
    _same_logprobs(got, want)
    assert any(o.finish_reason == FinishReason.STOP for o in got)   # some ended a step early
    if "num_pages" in engine_kw:
        assert run_async.scheduler.num_preemptions > 0
    for engine in (sync, run_async):
        alloc = engine.scheduler.allocator
        assert alloc.num_free == alloc.num_usable
        assert not engine.has_unfinished_requests()


def test_async_runs_one_step_ahead_with_tokens_from_the_device():
    engine = tiny_engine(async_scheduling=True)
    seen = []
    submit = engine.runner.submit

    def spy(inp):   # the packed input, unpacked on the host
        step_input = unpack(np.asarray(inp.buf), inp.spec, inp.prev_tokens)
        seen.append(np.asarray(step_input.prev_index).copy())
        return submit(inp)
    engine.runner.submit = spy
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request(random_prompts(1, seed=5)[0], params)
    assert engine.step() == []            # step 1 dispatched, nothing read back yet
    assert engine.has_unfinished_requests()
    outs = engine.step()                  # step 2 dispatched, step 1's token returned
    assert [len(o.new_token_ids) for o in outs] == [1]
    # Step 2's one token is step 1's sampled token, read on the device (row 0).
    assert seen[1][0] == 0 and (seen[1][1:] == -1).all() and (seen[0] == -1).all()
    total = [t for o in outs for t in o.new_token_ids]
    while engine.has_unfinished_requests():
        total += [t for o in engine.step() for t in o.new_token_ids]
    assert len(total) == 5
    sync = tiny_engine(async_scheduling=False)
    assert run_staggered(sync, random_prompts(1, seed=5), [params], [0])[0].token_ids == total
    # max_tokens is known ahead: no wasted step past the last token.
    assert engine.num_steps == 5


def test_a_greedy_step_reads_back_only_its_tokens(monkeypatch):
    """A step of greedy rows without logprobs (the `plain` variant) reads only its tokens
    from the device; a step with a logprobs row reads the logprob outputs too; either way the
    outputs are the synchronous engine's."""
    from jaxinfer import engine_outputs
    fetched = []
    fetch = engine_outputs.fetch
    monkeypatch.setattr(engine_outputs, "fetch", lambda x: fetched.append(x) or fetch(x))
    prompts = random_prompts(3, seed=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with_lp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    for params, kinds in (([greedy] * 3, {False}), ([with_lp] * 3, {True}),
                          ([greedy, with_lp, greedy], {False, True})):
        fetched.clear()
        got = run_staggered(tiny_engine(async_scheduling=True), prompts, params, [0, 0, 0])
        # Mixed: a step holding the logprobs row reads everything, one without it (the
        # chunked prompts are not all in one step) its tokens.
        assert {isinstance(x, SampleOutput) for x in fetched} <= kinds and fetched
        want = run_staggered(tiny_engine(async_scheduling=False), prompts, params, [0, 0, 0])
        assert _summary(got) == _summary(want)
        _same_logprobs(got, want)


def test_a_penalty_step_takes_the_tokens_first_and_the_text_after_its_dispatch():
    """A request with a penalty needs the last token before its next step; the rest of the
    step before it (text, logprobs, outputs) is done while that next step runs."""
    engine = tiny_engine(async_scheduling=True)
    events = []
    submit, text = engine.runner.submit, engine._text_outputs
    engine.runner.submit = lambda inp: events.append("dispatch") or submit(inp)
    engine._text_outputs = lambda *a: events.append("text") or text(*a)
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=6, repetition_penalty=1.3,
                            logprobs=1, ignore_eos=True)
    prompt = random_prompts(1, seed=6)[0]
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    # Each step's text after the next one's dispatch (never dispatch, text, dispatch).
    assert events[:5] == ["dispatch", "dispatch", "text", "dispatch", "text"], events
    assert events.count("text") == 6 and events.count("dispatch") == 6
    want = run_staggered(tiny_engine(async_scheduling=False), [prompt], [params], [0])[0]
    assert outs[-1].token_ids == want.token_ids and len(outs[-1].logprobs) == 6
    _same_logprobs([outs[-1]], [want])


def test_abort_while_a_step_is_in_flight():
    engine = tiny_engine(async_scheduling=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in random_prompts(4, seed=8)]
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None
    out = engine.abort_request(ids[2])
    assert out.finish_reason == FinishReason.CANCELLED and -1 not in out.token_ids
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id != ids[2]
            if o.finished:
                finals[o.request_id] = o
    assert sorted(finals) == sorted(i for i in ids if i != ids[2])
    assert all(len(o.token_ids) == 30 and -1 not in o.token_ids for o in finals.values())
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_usable


def test_on_wait_runs_once_a_step_after_its_dispatch_and_costs_the_step_nothing():
    """Engine.step's on_wait runs once per step: where a step is in flight, after the new
    step is dispatched and before the engine reads the one in flight; else as the step ends.
    Its seconds count in neither the step's time nor its host time."""
    import time

    engine = tiny_engine()
    engine.warmup(progress=False, variants=("plain",))    # no step compiles below
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt in random_prompts(4, seed=9):
        engine.add_request(prompt, params)
    seen = []

    def hook():
        seen.append((engine.num_steps, engine.num_generated))
        time.sleep(0.2)

    while engine.has_unfinished_requests():
        steps, generated, inflight = engine.num_steps, engine.num_generated, engine.inflight
        engine.step(on_wait=hook)
        assert len(seen) == 1, seen
        hooked_steps, hooked_generated = seen.pop()
        if inflight is not None and engine.num_steps > steps:
            # this call's step was dispatched, the one in flight not yet read
            assert (hooked_steps, hooked_generated) == (steps + 1, generated)
        assert engine.last_step_s < 0.2 and engine.last_host_s < 0.2, engine.last_step_s
