"""n completions of one prompt (SamplingParams.n): the prompt is computed once and its pages
shared, the partly filled last page copied on the device; greedy completions equal the
single request's output, seeded ones differ and reproduce; nothing leaks on abort."""
import pytest

from engine_util import (count_scheduled_tokens, random_prompts, run_alone, run_staggered,
                         tiny_engine)
from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import FinishReason, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# 21 tokens: the last prompt token starts a page (no copy); 23: it shares a page (a copy).
PROMPTS = {n: {"prompt_token_ids": list(range(7, 7 + n))} for n in (21, 23)}


def _all_pages_back(engine):
    alloc = engine.scheduler.allocator
    alloc.check()
    return alloc.num_free == alloc.num_usable


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("length", [21, 23])
def test_greedy_completions_equal_the_single_request(length, async_scheduling):
    prompt = PROMPTS[length]
    alone = run_alone(tiny_engine(async_scheduling=async_scheduling), prompt, GREEDY)
    engine = tiny_engine(async_scheduling=async_scheduling)
    out = run_alone(engine, prompt, SamplingParams(**{**vars(GREEDY), "n": 4}))
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == alone.token_ids for c in out.outputs)
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert out.token_ids == alone.token_ids and out.finish_reason == FinishReason.LENGTH
    assert _all_pages_back(engine)


@pytest.mark.parametrize("length", [21, 23])
def test_prompt_is_computed_once_and_its_pages_shared(length):
    engine = tiny_engine(async_scheduling=False)
    fed = count_scheduled_tokens(engine)
    engine.add_request(PROMPTS[length], SamplingParams(**{**vars(GREEDY), "n": 4}))
    engine.step()                                  # the prompt, then the fork
    alloc, page = engine.scheduler.allocator, engine.config.page_size
    shared = (length - 1) // page
    first = engine.scheduler.get("req-0#0").page_ids
    assert [alloc.ref_count(p) for p in first[:shared]] == [4] * shared
    pages = {p for rid in [f"req-0#{i}" for i in range(4)]
             for p in engine.scheduler.get(rid).page_ids}
    # The prompt's pages once, plus one copied page per fork when the last page is partial.
    assert len(pages) == -(-length // page) + 3 * ((length - 1) % page != 0)
    while engine.has_unfinished_requests():
        engine.step()
    # The prompt once, its last token once more per fork, then 9 decode tokens each.
    assert sum(fed) == length + 3 + 4 * (GREEDY.max_tokens - 1)
    assert _all_pages_back(engine)


def test_seeded_completions_differ_reproduce_and_match_their_seeds():
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True, n=3)
    prompt = PROMPTS[23]
    first = run_alone(tiny_engine(), prompt, params)
    again = run_alone(tiny_engine(), prompt, params)
    texts = [c.token_ids for c in first.outputs]
    assert len({tuple(t) for t in texts}) == 3
    assert texts == [c.token_ids for c in again.outputs]
    # Completion i samples as a single request seeded seed + i would.
    assert texts[2] == run_alone(tiny_engine(), prompt, params.for_completion(2)).token_ids


def test_unseeded_completions_differ():
    out = run_alone(tiny_engine(), PROMPTS[21],
                    SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=4))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_abort_one_completion_others_finish_nothing_leaks():
    engine = tiny_engine()
    engine.add_request(PROMPTS[23], SamplingParams(**{**vars(GREEDY), "n": 3}))
    final = []
    for step in range(40):
        if step == 3:
            assert engine.abort_request("req-0#1") is None   # two others still run
        final += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    [out] = final
    assert [c.finish_reason for c in out.outputs] == ["length", "cancelled", "length"]
    assert out.outputs[0].token_ids == out.outputs[2].token_ids
    assert len(out.outputs[0].token_ids) == 10 and len(out.outputs[1].token_ids) < 10
    assert _all_pages_back(engine)


@pytest.mark.parametrize("when", [0, 1, 4])
def test_abort_the_request_before_and_after_the_fork(when):
    engine = tiny_engine()
    rid = engine.add_request(PROMPTS[23], SamplingParams(**{**vars(GREEDY), "n": 4}))
    for _ in range(when):
        engine.step()
    out = engine.abort_request(rid)
    assert out.request_id == rid and len(out.outputs) == 4
    assert {c.finish_reason for c in out.outputs} == {"cancelled"}
    while engine.has_unfinished_requests():
        assert not engine.step()
    assert _all_pages_back(engine) and not engine.scheduler.requests


def test_completion_aborted_before_the_fork():
    engine = tiny_engine()
    engine.add_request(PROMPTS[21], SamplingParams(**{**vars(GREEDY), "n": 3}))
    assert engine.abort_request("req-0#2") is None
    final = [o for o in engine.run_until_done(use_tqdm=False).values()]
    [out] = final
    assert [c.finish_reason for c in out.outputs] == ["length", "length", "cancelled"]
    assert out.outputs[2].token_ids == []
    assert _all_pages_back(engine)


def test_with_other_requests_preemption_and_a_small_pool():
    prompts = random_prompts(5, seed=3)
    params = [SamplingParams(**{**vars(GREEDY), "n": n}) for n in (2, 1, 3, 1, 2)]
    alone = [run_alone(tiny_engine(), p, GREEDY).token_ids for p in prompts]
    engine = tiny_engine(num_pages=24, max_num_seqs=6)
    outs = run_staggered(engine, prompts, params, [0, 0, 1, 2, 2])
    assert engine.scheduler.num_preemptions > 0
    for out, n, want in zip(outs, (2, 1, 3, 1, 2), alone):
        assert [c.token_ids for c in out.outputs] == [want] * n
    assert _all_pages_back(engine)


def test_n_is_validated():
    with pytest.raises(InvalidRequestError, match="n must be >= 1") as e:
        SamplingParams(n=0)
    assert e.value.field == "n"
    engine = tiny_engine(max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="max_num_seqs") as e:
        engine.add_request(PROMPTS[21], SamplingParams(n=5))
    assert e.value.field == "n" and not engine.scheduler.requests
    engine.add_request(PROMPTS[21], SamplingParams(n=2), request_id="a")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(PROMPTS[21], SamplingParams(), request_id="a")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(PROMPTS[21], SamplingParams(), request_id="a#1")


def test_offline_file_writes_every_completion(tmp_path):
    import io
    import json

    from jaxinfer.batch_generate import generate_file

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [dict(PROMPTS[23], id="greedy", n=3, max_tokens=5, temperature=0.0),
             dict(PROMPTS[21], id="seeded", n=2, max_tokens=4, temperature=1.0, seed=5,
                  logprobs=1),
             dict(PROMPTS[21], id="one", max_tokens=4),
             {"custom_id": "batch", "method": "POST", "url": "/v1/completions", "body": {
                 "prompt": [PROMPTS[21]["prompt_token_ids"], PROMPTS[23]["prompt_token_ids"]],
                 "n": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                 "return_token_ids": True}}]
    inp.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    summary = generate_file(tiny_engine(), inp, out, log=io.StringIO())
    got = {r.get("custom_id") or r["id"]: r for r in map(json.loads,
                                                         out.read_text().splitlines())}
    assert summary["output_tokens"] == 15 + 8 + 4 + 12
    # The OpenAI batch format: choice p * n + i is prompt p's completion i.
    body = got["batch"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    ids = [c["token_ids"] for c in body["choices"]]
    assert ids[0] == ids[1] != ids[2] == ids[3] and len(ids[0]) == 3
    assert body["usage"]["prompt_tokens"] == 21 + 23
    assert body["usage"]["completion_tokens"] == 12
    g = got["greedy"]
    assert [o["index"] for o in g["outputs"]] == [0, 1, 2]
    assert all(o["token_ids"] == g["token_ids"] for o in g["outputs"])
    assert g["completion_tokens"] == 15 and g["outputs"][0]["text"] == g["text"]
    s = got["seeded"]
    assert s["outputs"][0]["token_ids"] != s["outputs"][1]["token_ids"]
    assert [len(o["logprobs"]) for o in s["outputs"]] == [4, 4]
    assert s["outputs"][1]["cumulative_logprob"] == pytest.approx(sum(
        d[str(t)] for d, t in zip(s["outputs"][1]["logprobs"], s["outputs"][1]["token_ids"])))
    assert "outputs" not in got["one"] and got["one"]["completion_tokens"] == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stepping_with_deltas_streams_each_completion(async_scheduling):
    """Stepping with deltas (the servers, AsyncLLM): each completion's progress comes out as
    an unfinished output of the request whose outputs[0] is that completion; the deltas of
    each index join to its final completion; the request's final output comes last."""
    engine = tiny_engine(async_scheduling=async_scheduling)
    rid = engine.add_request(PROMPTS[23], SamplingParams(max_tokens=8, temperature=1.0,
                                                         seed=5, n=3, ignore_eos=True))
    streamed, final = {0: [], 1: [], 2: []}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid and final is None
            if out.finished:
                final = out
                continue
            [c] = out.outputs
            streamed[c.index] += out.new_token_ids
            assert c.finish_reason in (None, "length")
    assert final is not None and [c.index for c in final.outputs] == [0, 1, 2]
    assert [streamed[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert len({tuple(t) for t in streamed.values()}) == 3
    assert _all_pages_back(engine)
