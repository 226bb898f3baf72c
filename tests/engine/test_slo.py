"""Latency budgets (jaxinfer/slo.py): the step-time model, priority order, and admission by
predicted completion, on the tiny engine with a simulated clock that advances by a known
cost per step."""
import numpy as np
import pytest

from engine_util import random_prompts, tiny_engine
from jaxinfer.config import EngineConfig
from jaxinfer.errors import ConfigError, DeadlineError, InvalidRequestError, InvalidTypeError
from jaxinfer.request import Request, SamplingParams
from jaxinfer.scheduler import ScheduledRow, Scheduler, SchedulerOutput
from jaxinfer.slo import StepTimeModel

# seconds: per step, per token, per row, per context token
COST = (2e-3, 50e-6, 20e-6, 1e-6)


def _cost(out) -> float:
    tokens = sum(len(r.token_ids) for r in out.rows)
    context = sum(r.start_pos + len(r.token_ids) for r in out.rows)
    return COST[0] + COST[1] * tokens + COST[2] * len(out.rows) + COST[3] * context


def test_the_step_time_model_recovers_a_linear_cost_and_keeps_coefficients_non_negative():
    rng = np.random.default_rng(0)
    model = StepTimeModel(refit_every=8)
    assert model.predict(10, 2, 100) is None        # nothing seen: no prediction
    for _ in range(64):
        tokens, rows = int(rng.integers(1, 256)), int(rng.integers(1, 32))
        context = int(rng.integers(0, 4096))
        model.observe(tokens, rows, context, 2e-3 + 50e-6 * tokens + 1e-6 * context
                      + float(rng.normal(0, 1e-5)))
    assert model.predict(100, 8, 1000) == pytest.approx(2e-3 + 5e-3 + 1e-3, rel=0.02)
    assert (model.coefs >= 0).all()
    # a cost that falls with rows (noise a plain fit would follow) is fitted without it
    flat = StepTimeModel(refit_every=8)
    for _ in range(32):
        tokens, rows = int(rng.integers(1, 256)), int(rng.integers(1, 32))
        flat.observe(tokens, rows, 0, 1e-3 + 1e-4 * tokens - 1e-6 * rows)
    assert flat.coefs[2] == 0 and flat.predict(20, 5, 0) > 0


@pytest.mark.parametrize("value", [-1.0, float("inf"), "4", True])
def test_a_bad_itl_target_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match="itl_target_ms must be a number >= 0"):
        EngineConfig(itl_target_ms=value)


def test_a_bad_deadline_is_refused_naming_it(engine):
    for bad, kind in ((0, InvalidRequestError), (-1.0, InvalidRequestError),
                      (float("nan"), InvalidRequestError), ("5", InvalidTypeError)):
        with pytest.raises(kind, match="deadline must be") as e:
            engine.add_request({"prompt_token_ids": [5, 6]}, deadline=bad)
        assert e.value.field == "deadline"
    assert not engine.scheduler.requests


def _scheduler(**kw):
    return Scheduler(max_num_seqs=2, max_num_batched_tokens=16, page_size=4, num_pages=64,
                     max_model_len=64, **kw)


def test_the_queue_takes_lower_priority_values_first_then_arrival_order():
    sched = _scheduler()
    for rid, priority in [("a", 0), ("b", 1), ("c", 0), ("d", -1), ("e", 1)]:
        sched.add(Request(rid, [5, 6, 7], SamplingParams(max_tokens=2), priority=priority))
    assert [r.request_id for r in sched.waiting] == ["d", "a", "c", "b", "e"]
    with pytest.raises(InvalidRequestError, match="priority must be an integer"):
        Request("x", [5], priority=0.5)


def test_a_deadline_is_refused_only_when_predicted_late():
    t = [0.0]
    sched = _scheduler(clock=lambda: t[0])

    def add(rid, deadline, max_tokens=8):
        sched.add(Request(rid, list(range(5, 17)), SamplingParams(max_tokens=max_tokens),
                          arrival_time=t[0], deadline=t[0] + deadline))

    add("early", 1e-6)          # no model fitted yet: admitted whatever its deadline
    sched.deadlines.model.set(0.01, 0.0, 0.0, 0.0)    # 10 ms a step
    # 12 prompt tokens in one step, then 8 tokens: ~9-10 steps; the queue holds one ahead
    with pytest.raises(DeadlineError, match="after its deadline"):
        add("late", 0.05)
    assert "late" not in sched.requests and len(sched.waiting) == 1
    add("fits", 0.5)
    assert [r.request_id for r in sched.waiting] == ["early", "fits"]
    t[0] = 10.0
    with pytest.raises(DeadlineError, match="has passed"):
        sched.deadlines.check(Request("past", [5], deadline=9.0))


def test_steps_are_timed_only_once_a_request_with_a_deadline_came():
    sched = _scheduler()
    out = SchedulerOutput((ScheduledRow("a", (5, 6), 0, np.zeros(1, np.int32), True),))
    sched.deadlines.observe_step(out, 0.01)
    sched.add(Request("a", [5, 6, 7]))
    sched.deadlines.observe_step(out, 0.01)
    assert sched.deadlines.model._count == 0       # no deadline yet: no cost per step
    sched.add(Request("b", [5, 6, 7], deadline=sched.clock() + 60))
    sched.deadlines.observe_step(out, 0.01)
    assert sched.deadlines.model._count == 1


def _simulate(engine, arrivals, deadline, max_tokens):
    """Run the engine on a simulated clock: each scheduled step advances it by _cost. Adds
    the prompts of `arrivals` ({step: prompts}) before those steps, each with `deadline`
    seconds. Returns ({request id: (arrival, absolute deadline, finish)}, refused errors)."""
    t = [0.0]
    sched = engine.scheduler
    clock, sched.clock = sched.clock, lambda: t[0]
    schedule = sched.schedule

    def timed(*args, **kw):
        out = schedule(*args, **kw)
        t[0] += _cost(out) if out.rows else 0.0
        return out
    sched.schedule = timed
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    admitted, refused, step = {}, [], 0
    try:
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for prompt in arrivals.get(step, []):
                try:
                    rid = engine.add_request(prompt, params, deadline=deadline)
                    admitted[rid] = [t[0], t[0] + deadline, None]
                except DeadlineError as e:
                    refused.append(e)
            for out in engine.step():
                if out.finished:
                    admitted[out.request_id][2] = t[0]
            step += 1
    finally:
        del sched.schedule                  # the class's method again
        sched.clock = clock
    return admitted, refused


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=8, max_num_batched_tokens=64)


def test_under_an_overload_burst_the_admitted_meet_their_deadline_and_the_rest_are_refused(
        engine):
    """Two bursts of 40 requests (prompts of 3-40 tokens, 8 tokens each) against a 120 ms
    budget on the simulated clock: more than the engine can finish in time. With the step
    cost known to the model, every admitted request finishes within its deadline, the rest
    are refused at once with DeadlineError, and no page is left held."""
    model = StepTimeModel(refit_every=10**9)     # the cost is known: no refit from the CPU
    model.set(*COST)
    engine.scheduler.deadlines.model = model
    prompts = random_prompts(80, seed=1)
    admitted, refused = _simulate(engine, {0: prompts[:40], 12: prompts[40:]},
                                  deadline=0.12, max_tokens=8)
    late = {rid: v for rid, v in admitted.items() if v[2] is None or v[2] > v[1]}
    assert not late, late
    assert len(admitted) >= 16 and len(refused) >= 16, (len(admitted), len(refused))
    assert all("after its deadline" in str(e) for e in refused)
    # the second burst found room again once the first drained
    assert any(v[0] > 0 for v in admitted.values())
    a = engine.scheduler.allocator
    assert not engine.scheduler.requests and a.num_free == a.num_usable


def test_without_deadlines_the_schedule_and_outputs_are_unchanged(engine):
    """The same burst with no deadline, and with deadlines too long to bind: the same steps
    and the same tokens."""
    model = StepTimeModel(refit_every=10**9)
    model.set(*COST)
    engine.scheduler.deadlines.model = model
    runs = []
    for deadline in (None, 1e6):
        steps = []
        engine.scheduler.allocator.forget_cache()    # the second run finds no cached prefix
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda *a, **k: steps.append(schedule(*a, **k)) or steps[-1]
        try:
            ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0),
                                      deadline=deadline) for p in random_prompts(24, seed=2)]
            final = engine.run_until_done(use_tqdm=False)
        finally:
            del engine.scheduler.schedule
        runs.append(([[(r.token_ids, r.start_pos) for r in s.rows] for s in steps],
                     [final[i].outputs[0].token_ids for i in ids]))
    assert runs[0] == runs[1]


def _run_with_costs(engine, prompts, arrivals, max_tokens=12):
    """Greedy requests added before the steps `arrivals` name; each step's simulated cost
    and its rows (with the fixed model COST), and the final tokens by prompt."""
    model = StepTimeModel(refit_every=10**9)
    model.set(*COST)
    engine.scheduler.deadlines.model = model
    steps, schedule = [], engine.scheduler.schedule

    def timed(*args, **kw):
        out = schedule(*args, **kw)
        if out.rows:
            steps.append((_cost(out), out))
        return out
    engine.scheduler.schedule = timed
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids, final, step = {}, {}, 0
    try:
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for i, at in enumerate(arrivals):
                if at == step:
                    ids[engine.add_request(prompts[i], params)] = i
            for out in engine.step():
                if out.finished:
                    final[ids[out.request_id]] = out.token_ids
            step += 1
    finally:
        del engine.scheduler.schedule
    return steps, [final[i] for i in range(len(prompts))]


def test_an_itl_target_keeps_decode_steps_under_it_while_long_prompts_drain():
    """Four short requests decode while three 60-token prompts arrive. Without a target the
    prompts' chunks fill the 64-token budget and those steps cost ~5.7 ms; with a 4 ms
    target every step that carries a decoding row stays within it (up to the context's
    growth since the last step), the prompts still finish, and the tokens are the same."""
    prompts = ([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]
               + [{"prompt_token_ids": list(range(10 + i, 70 + i))} for i in range(3)])
    arrivals = [0, 0, 0, 0, 3, 3, 4]
    runs = {}
    for target in (0.0, 4.0):
        engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=64, itl_target_ms=target)
        runs[target] = _run_with_costs(engine, prompts, arrivals)
        a = engine.scheduler.allocator
        assert not engine.scheduler.requests and a.num_free == a.num_usable

    def decode_steps(steps):
        return [cost for cost, out in steps
                if any(len(r.token_ids) == 1 and r.start_pos > 3 for r in out.rows)]

    free, held = decode_steps(runs[0.0][0]), decode_steps(runs[4.0][0])
    assert max(free) > 5e-3, free                   # the budget alone lets them stretch
    assert max(held) <= 4e-3 * 1.05, held
    assert len(runs[4.0][0]) > len(runs[0.0][0])    # the prompts took more, smaller steps
    assert runs[4.0][1] == runs[0.0][1]
