"""Scheduler: budgets, chunked prefill, prefix caching, preemption, finishing rules, no leaks.

A fake device stands in for the model: it writes each fed token into a host "KV cache" at the
slot the batch arrays name, then reads the row's whole context back through its page table
and derives the next token from it. So a request's outputs match a solo run only if every
token landed in the right page and shared / recomputed pages hold the right content.
"""
import random
import zlib

import numpy as np
import pytest

from jaxinfer.batch import prepare
from jaxinfer.buckets import Buckets
from jaxinfer.config import EngineConfig
from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import FinishReason, Request, RequestStatus, SamplingParams
from jaxinfer.scheduler import Scheduler

VOCAB = 97


def next_token(context) -> int:
    return zlib.crc32(np.asarray(context, np.int64).tobytes()) % VOCAB


def solo_output(prompt, max_tokens, max_model_len=10**9, eos=()):
    seq = list(prompt)
    out = []
    while True:
        t = next_token(seq)
        out.append(t)
        seq.append(t)
        if t in eos or len(out) >= max_tokens or len(seq) >= max_model_len:
            return out


class FakeDevice:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv = np.full(sched.allocator.num_pages * sched.page_size, -1, np.int64)
        self.buckets = Buckets(sched.max_num_seqs, sched.max_num_batched_tokens,
                               -(-sched.max_model_len // sched.page_size))

    def step(self):
        out = self.sched.schedule()
        if out.is_empty:
            return out, []
        s = self.sched.page_size
        arr = prepare(out, self.buckets.choose(out.num_tokens, out.num_rows, out.max_pages), s)
        real = arr.slot_mapping >= 0
        self.kv[arr.slot_mapping[real]] = arr.tokens[real]
        sampled = []
        for b in range(arr.num_rows):
            pos = np.arange(arr.seq_lens[b])
            context = self.kv[arr.page_table[b, pos // s] * s + pos % s]
            assert (context >= 0).all()
            sampled.append(next_token(context))
        return out, self.sched.update(out, sampled)


def make_sched(**kw):
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=64,
                max_model_len=256, enable_prefix_caching=True)
    args.update(kw)
    return Scheduler(**args)


def rand_prompt(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


def run_all(dev: FakeDevice, max_steps=10_000):
    done, steps = {}, 0
    while dev.sched.has_unfinished:
        out, updated = dev.step()
        assert out.num_tokens <= dev.sched.max_num_batched_tokens
        assert out.num_rows <= dev.sched.max_num_seqs
        assert len({r.request_id for r in out.rows}) == out.num_rows
        dev.sched.allocator.check()
        done.update({r.request_id: r for r in updated if r.is_finished})
        steps += 1
        assert steps < max_steps
    return done


def test_random_requests_complete_within_budgets_and_match_solo_runs():
    rng = random.Random(0)
    sched = make_sched()
    dev = FakeDevice(sched)
    reqs = [Request(f"r{i}", rand_prompt(rng, rng.randrange(1, 40)),
                    SamplingParams(max_tokens=rng.randrange(1, 20))) for i in range(12)]
    for r in reqs:
        sched.add(r)
    done = run_all(dev)
    for r in reqs:
        assert done[r.request_id].output_token_ids == solo_output(
            r.prompt_token_ids, r.sampling_params.max_tokens)
        assert r.finish_reason == FinishReason.LENGTH
    assert sched.allocator.num_free == sched.allocator.num_usable


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill(budget):
    rng = random.Random(budget)
    sched = make_sched(max_num_batched_tokens=budget, enable_prefix_caching=False)
    dev = FakeDevice(sched)
    prompt = rand_prompt(rng, 100)
    sched.add(Request("long", prompt, SamplingParams(max_tokens=5)))
    fed = []
    while True:
        out, updated = dev.step()
        (row,) = out.rows
        assert row.num_tokens <= budget and row.start_pos == len(fed)
        fed += row.token_ids
        if len(fed) < len(prompt):
            assert not row.samples and not updated   # only the chunk ending the prompt samples
        else:
            assert row.samples
            break
    assert fed == prompt
    assert sched.get("long").num_output_tokens == 1
    done = run_all(dev)
    assert done["long"].output_token_ids == solo_output(prompt, 5)


def test_decode_rows_and_prefill_chunks_share_a_step():
    rng = random.Random(5)
    sched = make_sched(max_num_batched_tokens=16)
    dev = FakeDevice(sched)
    sched.add(Request("a", rand_prompt(rng, 6), SamplingParams(max_tokens=20)))
    dev.step()
    sched.add(Request("b", rand_prompt(rng, 40), SamplingParams(max_tokens=3)))
    out, _ = dev.step()
    assert [(r.request_id, r.num_tokens, r.samples) for r in out.rows] == [
        ("a", 1, True), ("b", 15, False)]


def test_prefix_cache_hit_on_shared_prefix():
    rng = random.Random(6)
    sched = make_sched(page_size=8)
    dev = FakeDevice(sched)
    shared = rand_prompt(rng, 40)
    sched.add(Request("first", shared + rand_prompt(rng, 5), SamplingParams(max_tokens=4)))
    run_all(dev)
    second = shared + rand_prompt(rng, 9)
    sched.add(Request("second", second, SamplingParams(max_tokens=4)))
    out, _ = dev.step()
    assert out.rows[0].start_pos == 40 and out.rows[0].token_ids == tuple(second[40:])
    done = run_all(dev)
    assert done["second"].num_prefix_hit_tokens == 40
    assert done["second"].output_token_ids == solo_output(second, 4)
    assert sched.allocator.hit_tokens == 40
    assert sched.allocator.queried_tokens == 45 + 49


def test_identical_prompt_keeps_one_token_to_compute():
    rng = random.Random(7)
    sched = make_sched(page_size=8)
    dev = FakeDevice(sched)
    prompt = rand_prompt(rng, 32)
    for name in ("x", "y"):
        sched.add(Request(name, prompt, SamplingParams(max_tokens=3)))
        done = run_all(dev)
    assert done["y"].num_prefix_hit_tokens == 24   # 3 of 4 pages: the last token is computed
    assert done["y"].output_token_ids == solo_output(prompt, 3)


def test_preemption_with_tiny_pool_still_completes():
    rng = random.Random(8)
    sched = make_sched(num_pages=13, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    dev = FakeDevice(sched)
    reqs = [Request(f"p{i}", rand_prompt(rng, 10), SamplingParams(max_tokens=25))
            for i in range(4)]
    for r in reqs:
        sched.add(r)
    done = run_all(dev)
    assert sched.num_preemptions > 0
    assert reqs[0].num_preemptions == 0   # the oldest request is never the victim
    for r in reqs:
        assert done[r.request_id].output_token_ids == solo_output(r.prompt_token_ids, 25)
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_preempted_request_goes_to_queue_head_and_keeps_its_tokens():
    rng = random.Random(9)
    sched = make_sched(num_pages=5, page_size=4, max_num_batched_tokens=64)   # 4 usable
    dev = FakeDevice(sched)
    sched.add(Request("old", rand_prompt(rng, 8), SamplingParams(max_tokens=8)))
    sched.add(Request("new", rand_prompt(rng, 8), SamplingParams(max_tokens=8)))
    sched.add(Request("later", rand_prompt(rng, 3), SamplingParams(max_tokens=1)))
    dev.step()
    out, _ = dev.step()   # both need a 3rd page, only "old" gets one
    assert out.preempted_ids == ("new",)
    new = sched.get("new")
    assert new.status == RequestStatus.PREEMPTED and new.num_output_tokens == 1
    assert new.page_ids == [] and [r.request_id for r in sched.waiting] == ["new", "later"]
    out, _ = dev.step()   # "later" may not pass the preempted request
    assert [r.request_id for r in out.rows] == ["old"]
    done = run_all(dev)
    assert done["new"].output_token_ids == solo_output(new.prompt_token_ids, 8)


def test_preemption_takes_the_lowest_priority_first_and_requeues_it_by_priority():
    """vLLM's priority rule: the victim is the newest running request of the lowest priority
    (here the older one), and it waits behind better priorities but ahead of its own."""
    rng = random.Random(10)
    sched = make_sched(num_pages=5, page_size=4, max_num_batched_tokens=64)   # 4 usable
    dev = FakeDevice(sched)
    sched.add(Request("low", rand_prompt(rng, 8), SamplingParams(max_tokens=8), priority=1))
    sched.add(Request("high", rand_prompt(rng, 8), SamplingParams(max_tokens=8)))
    out, _ = dev.step()
    assert [r.request_id for r in out.rows] == ["high", "low"]
    sched.add(Request("low2", rand_prompt(rng, 3), SamplingParams(max_tokens=1), priority=1))
    sched.add(Request("mid", rand_prompt(rng, 3), SamplingParams(max_tokens=1)))
    out, _ = dev.step()   # both running need a 3rd page: the priority-1 one gives way
    assert out.preempted_ids == ("low",) and [r.request_id for r in out.rows] == ["high"]
    assert [r.request_id for r in sched.waiting] == ["mid", "low", "low2"]
    done = run_all(dev)
    for rid in ("low", "high"):
        assert done[rid].output_token_ids == solo_output(done[rid].prompt_token_ids, 8)
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_a_step_just_over_a_shape_is_cut_to_it_and_one_well_over_is_padded():
    """With compiled shapes 16..512 (buckets.SHAPE_OVERHEAD_TOKENS 256): a 300-token prompt runs as
    256 then 44 tokens (300 in a 512 shape computes fewer real tokens per step-time than 256
    in a 256 one); a 450-token prompt runs whole; the answers are unchanged."""
    rng = random.Random(11)
    sched = make_sched(max_num_batched_tokens=512, num_pages=400, max_model_len=1024)
    sched.token_shapes = (16, 32, 64, 128, 256, 512)
    dev = FakeDevice(sched)
    sched.add(Request("a", rand_prompt(rng, 300), SamplingParams(max_tokens=3)))
    out, _ = dev.step()
    assert [(r.request_id, r.num_tokens, r.samples) for r in out.rows] == [("a", 256, False)]
    out, _ = dev.step()
    assert [(r.num_tokens, r.samples) for r in out.rows] == [(44, True)]
    sched.add(Request("b", rand_prompt(rng, 450), SamplingParams(max_tokens=3)))
    out, _ = dev.step()
    assert [(r.request_id, r.num_tokens) for r in out.rows] == [("a", 1), ("b", 450)]
    done = run_all(dev)
    for rid in "ab":
        assert done[rid].output_token_ids == solo_output(done[rid].prompt_token_ids, 3)
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_random_driver_never_leaks_pages():
    rng = random.Random(10)
    sched = make_sched(num_pages=17, page_size=4, max_num_seqs=3, max_num_batched_tokens=13,
                       max_model_len=48, eos_token_ids=(3,))
    dev = FakeDevice(sched)
    prefixes = [rand_prompt(rng, 12) for _ in range(3)]
    n_added = n_checked = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.25:
            prefix = rng.choice(prefixes)[:rng.randrange(13)]
            prompt = prefix + rand_prompt(rng, rng.randrange(1, 20))
            sched.add(Request(f"q{n_added}", prompt,
                              SamplingParams(max_tokens=rng.randrange(1, 30),
                                             ignore_eos=rng.random() < 0.5)))
            n_added += 1
        elif op < 0.32 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
        elif op < 0.36 and sched.requests:
            sched.finish(rng.choice(list(sched.requests)), FinishReason.STOP)
        else:
            for r in dev.step()[1]:
                if r.is_finished:
                    ref = solo_output(r.prompt_token_ids, r.sampling_params.max_tokens, 48,
                                      () if r.sampling_params.ignore_eos else (3,))
                    assert r.output_token_ids == ref
                    n_checked += 1
        sched.allocator.check()
    assert sched.num_preemptions > 0 and sched.allocator.hit_tokens > 0 and n_checked > 10
    for rid in list(sched.requests):
        sched.abort(rid)
    assert sched.allocator.num_free == sched.allocator.num_usable


def one_step_then(sched, token, **params):
    sched.add(Request("r", [5, 6, 7], SamplingParams(**params)))
    out = sched.schedule()
    return sched.update(out, [token])[0]


@pytest.mark.parametrize("token,params,reason", [
    (2, dict(max_tokens=5), FinishReason.STOP),                     # eos
    (2, dict(max_tokens=5, ignore_eos=True), None),
    (9, dict(max_tokens=5, stop_token_ids=(9,)), FinishReason.STOP),
    (9, dict(max_tokens=5, stop_token_ids=(9,), ignore_eos=True), FinishReason.STOP),
    (4, dict(max_tokens=1), FinishReason.LENGTH),
    (4, dict(max_tokens=5), None),
])
def test_finishing_rules(token, params, reason):
    sched = make_sched(eos_token_ids=(2,))
    r = one_step_then(sched, token, **params)
    assert r.finish_reason == reason and r.output_token_ids == [token]
    assert r.is_finished == (reason is not None)
    assert sched.allocator.num_used == (0 if reason else 1)


def test_max_model_len_finishes_with_length():
    sched = make_sched(max_model_len=4)
    r = one_step_then(sched, 4, max_tokens=50)
    assert r.finish_reason == FinishReason.LENGTH and r.num_tokens == 4


def test_add_rejects_bad_requests():
    sched = make_sched(num_pages=5, page_size=4, max_model_len=64)   # 16 tokens of KV
    sched.add(Request("a", [1, 2], SamplingParams(max_tokens=3)))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add(Request("a", [1, 2]))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        sched.add(Request("long", list(range(64))))
    with pytest.raises(InvalidRequestError, match="pool holds 16"):
        sched.add(Request("big", [1] * 10, SamplingParams(max_tokens=10)))
    with pytest.raises(InvalidRequestError, match="empty"):
        Request("e", [])


def test_abort_and_external_finish_free_pages():
    sched = make_sched()
    sched.add(Request("run", list(range(10)), SamplingParams(max_tokens=9)))
    sched.add(Request("wait", list(range(10)), SamplingParams(max_tokens=9)))
    out = sched.schedule()
    sched.update(out, [1] * out.num_rows)
    assert sched.allocator.num_used > 0
    r = sched.finish("run", FinishReason.STOP)
    assert r.finish_reason == FinishReason.STOP and r.page_ids == []
    assert sched.abort("wait").finish_reason == FinishReason.CANCELLED
    assert sched.abort("wait") is None and not sched.has_unfinished
    with pytest.raises(KeyError, match="no unfinished request"):
        sched.finish("wait", FinishReason.STOP)
    assert sched.stats()["kv_pages_used"] == 0 and sched.stats()["num_running"] == 0
    assert sched.allocator.num_used == 0
    assert sched.update(out, [1] * out.num_rows) == []   # stale rows of finished requests


def test_ttft_and_latency_use_the_clock():
    now = [100.0]
    sched = make_sched(clock=lambda: now[0], max_num_batched_tokens=4)
    sched.add(Request("t", list(range(6)), SamplingParams(max_tokens=2), arrival_time=99.0))
    for t in (100.0, 101.0, 102.0):
        now[0] = t
        r = sched.update(out := sched.schedule(), [7] * out.num_rows)
    assert r[0].ttft_s == 2.0 and r[0].latency_s == 3.0


def test_from_config():
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    sched = Scheduler.from_config(cfg, eos_token_ids=(2,))
    assert sched.allocator.num_pages == cfg.total_pages and sched.eos_token_ids == {2}
