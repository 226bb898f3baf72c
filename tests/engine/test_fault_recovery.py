"""A step that raises fails exactly its requests; the engine rebuilds a KV cache the failed
step consumed, recomputes everything else, and carries on with outputs token-identical to a
clean run (faults injected through ModelRunner.fault_hook)."""
import jax
import numpy as np
import pytest

from engine_util import random_prompts, run_staggered, tiny_engine
from jaxinfer.errors import EngineDeadError
from jaxinfer.request import FinishReason, SamplingParams

PHASES = ("dispatch", "dispatched", "fetch")


class Faults:
    """A fault_hook raising at chosen (phase, call number) points, or at random ones; at
    "dispatched" it first deletes the KV cache, as a step that failed after its cache was
    donated leaves it. Records the request ids of each failed step (at "dispatched", those of
    the step last dispatched: the hook may run on the dispatch thread)."""

    def __init__(self, engine, at=(), rate=0.0, seed=0, delete_kv=True):
        self.engine, self.at, self.rate, self.delete_kv = engine, set(at), rate, delete_kv
        self.rng = np.random.default_rng(seed)
        self.calls = dict.fromkeys(PHASES, 0)
        self.blamed: list[set[str]] = []

    def __call__(self, phase, runner):
        self.calls[phase] += 1
        if phase == "dispatch":
            self.dispatching = {r.request_id for r in self.engine._blame.rows}
        if (phase, self.calls[phase]) not in self.at and not self.rng.random() < self.rate:
            return
        self.blamed.append(self.dispatching if phase == "dispatched"
                           else {r.request_id for r in self.engine._blame.rows})
        if phase == "dispatched" and self.delete_kv:
            for x in jax.tree_util.tree_leaves(runner.kv):
                x.delete()
        raise RuntimeError(f"injected fault at {phase}")


def workload(n=12, seed=5):
    prompts = random_prompts(n, seed=seed)
    params = [SamplingParams(max_tokens=int(m), temperature=0.0) if i % 3 else
              SamplingParams(max_tokens=int(m), temperature=0.8, top_p=0.9, seed=i)
              for i, m in enumerate(np.random.default_rng(seed).integers(4, 20, n))]
    arrivals = [i // 3 for i in range(n)]
    return prompts, params, arrivals


@pytest.fixture(scope="module")
def clean():
    """Outputs of each engine form without faults: {async_scheduling: outputs}."""
    prompts, params, arrivals = workload()
    return {a: [o.token_ids for o in run_staggered(tiny_engine(async_scheduling=a), prompts,
                                                   params, arrivals)]
            for a in (False, True)}


def check_recovered(engine, faults, outs, clean_ids):
    failed = {o.request_id for o in outs if o.finish_reason == FinishReason.ERROR}
    assert failed and failed <= set().union(*faults.blamed)
    for o, want in zip(outs, clean_ids):
        if o.finish_reason == FinishReason.ERROR:
            assert o.error.startswith("RuntimeError: injected fault")
        else:
            assert o.token_ids == want, o.request_id
    alloc = engine.scheduler.allocator
    alloc.check()
    assert alloc.num_used == 0 and not engine.has_unfinished_requests()
    assert not engine.runner.kv_lost()
    return failed


@pytest.mark.parametrize("async_scheduling", [False, True, "thread"])
@pytest.mark.parametrize("phase", PHASES)
def test_one_failed_step_fails_only_its_requests(phase, async_scheduling, clean):
    """"thread": async scheduling with steps dispatched from the dispatch thread."""
    engine = tiny_engine(async_scheduling=bool(async_scheduling))
    if async_scheduling == "thread":
        engine.runner.start_dispatch_thread()
        async_scheduling = True
    engine.runner.fault_hook = faults = Faults(engine, at=[(phase, 4)])
    prompts, params, arrivals = workload()
    outs = run_staggered(engine, prompts, params, arrivals)
    failed = check_recovered(engine, faults, outs, clean[async_scheduling])
    assert len(faults.blamed) == 1 and failed == faults.blamed[0]
    # The engine goes on serving: the same workload again, no faults, the clean outputs.
    engine.runner.fault_hook = None
    assert [o.token_ids for o in run_staggered(engine, prompts, params, arrivals)] == clean[
        async_scheduling]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_failures(async_scheduling, clean):
    engine = tiny_engine(async_scheduling=async_scheduling)
    engine.runner.fault_hook = faults = Faults(engine, rate=0.08, seed=async_scheduling + 1)
    prompts, params, arrivals = workload()
    outs = run_staggered(engine, prompts, params, arrivals)
    check_recovered(engine, faults, outs, clean[async_scheduling])
    assert len(faults.blamed) >= 2


def test_failure_without_losing_the_cache_keeps_the_prefix_cache():
    """A step that fails before its call consumed anything leaves the cache (and the prefix
    cache's pages) as they were."""
    engine = tiny_engine()
    prompt = random_prompts(1, lo=30, hi=31, seed=9)[0]
    run_staggered(engine, [prompt], [SamplingParams(max_tokens=2, temperature=0.0)], [0])
    cached = engine.scheduler.allocator.num_cached
    engine.runner.fault_hook = Faults(engine, at=[("dispatch", 1)])
    kv = engine.runner.kv
    [out] = run_staggered(engine, [prompt], [SamplingParams(max_tokens=2, temperature=0.0)],
                          [0])
    assert out.finish_reason == FinishReason.ERROR
    assert engine.runner.kv is kv and engine.scheduler.allocator.num_cached == cached


def test_a_failing_detokenizer_fails_one_request():
    engine = tiny_engine()
    prompts, params, arrivals = workload(n=4)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]

    def broken(token, done, defer=False):
        raise ValueError("bad bytes")

    engine._text[rids[1]].add = broken
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    assert final[rids[1]].finish_reason == FinishReason.ERROR
    assert final[rids[1]].error == "ValueError: bad bytes"
    assert all(final[r].finish_reason != FinishReason.ERROR for r in rids if r != rids[1])
    assert engine.scheduler.allocator.num_used == 0


def test_failed_recovery_is_engine_dead(monkeypatch):
    engine = tiny_engine()
    engine.runner.fault_hook = Faults(engine, at=[("dispatched", 1)])

    def no_memory():
        raise MemoryError("no room for a new cache")

    monkeypatch.setattr(engine.runner, "rebuild_kv", no_memory)
    engine.add_request(random_prompts(1)[0], SamplingParams(max_tokens=3))
    with pytest.raises(EngineDeadError, match="no room for a new cache"):
        engine.step()
