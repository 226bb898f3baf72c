"""Offline batch generation (jaxinfer.batch_generate): results equal the engine run directly,
a crashed run resumes without duplicates, bad lines are reported and skipped. One CLI run with
the real model: test_batch_generate_cli; the OpenAI batch format: test_openai_batch."""
import dataclasses
import io

import numpy as np
import pytest

from engine_util import random_prompts, read_jsonl, tiny_engine, write_jsonl
from jaxinfer.batch_generate import generate_file
from jaxinfer.errors import JaxinferError
from jaxinfer.request import SamplingParams

DEFAULTS = SamplingParams(temperature=0.0, max_tokens=6)
SUMMARY_KEYS = {"requests", "skipped_done", "rejected", "rejected_lines", "prompt_tokens",
                "output_tokens", "wall_s", "requests_per_s", "output_tokens_per_s",
                "ttft_p50_s", "ttft_p99_s", "per_token_latency_p50_s",
                "per_token_latency_p99_s", "steps", "compiles"}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def request_lines(n=9, seed=3):
    """Greedy requests with per-line max_tokens; every third has no id (line-number id)."""
    rng = np.random.default_rng(seed)
    lines = []
    for i, p in enumerate(random_prompts(n, seed=seed)):
        line = dict(p, max_tokens=int(rng.integers(2, 10)))
        if i % 3:
            line["id"] = f"r{i}" if i % 2 else i
        if i == 4:
            line["logprobs"] = 2
            line["prompt_logprobs"] = 1
        lines.append(line)
    return lines


def expected_id(i, line):
    return line.get("id", f"line-{i + 1}")


@pytest.fixture(scope="module")
def reference(engine):
    """The same requests run LLM.generate-style: all added at once, run until done."""
    lines = request_lines()
    ids = [engine.add_request({"prompt_token_ids": ln["prompt_token_ids"]},
                              dataclasses.replace(DEFAULTS, max_tokens=ln["max_tokens"],
                                                  logprobs=ln.get("logprobs"),
                                                  prompt_logprobs=ln.get("prompt_logprobs")))
           for ln in lines]
    done = engine.run_until_done(use_tqdm=False)
    return lines, {expected_id(i, ln): done[rid] for i, (ln, rid) in enumerate(zip(lines, ids))}


def test_results_match_engine_and_summary(engine, reference, tmp_path):
    lines, ref = reference
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    summary = generate_file(engine, inp, out, DEFAULTS, max_queued=3, log=io.StringIO())
    results = read_jsonl(out)
    assert sorted(map(str, (r["id"] for r in results))) == sorted(map(str, ref))
    for r in results:
        o = ref[r["id"]]
        assert r["token_ids"] == o.token_ids
        assert r["finish_reason"] == str(o.finish_reason)
        assert r["prompt_tokens"] == len(o.prompt_token_ids)
        assert r["completion_tokens"] == len(o.token_ids) <= 9
        assert 0 <= r["ttft_s"] <= r["latency_s"]
        assert ("logprobs" in r) == (r["id"] == 4)
    with_lp = next(r for r in results if r["id"] == 4)
    assert len(with_lp["logprobs"]) == with_lp["completion_tokens"]
    assert all(str(t) in d for t, d in zip(with_lp["token_ids"], with_lp["logprobs"]))
    assert with_lp["prompt_logprobs"] == [   # batched differently: equal to float32 rounding
        None if d is None else {str(t): pytest.approx(lp.logprob, abs=1e-5)
                                for t, lp in d.items()}
        for d in ref[4].prompt_logprobs]
    assert sum("prompt_logprobs" in r for r in results) == 1
    assert set(summary) == SUMMARY_KEYS
    assert summary["requests"] == len(lines) and summary["rejected"] == 0
    assert summary["output_tokens"] == sum(r["completion_tokens"] for r in results)
    assert summary["ttft_p50_s"] <= summary["ttft_p99_s"]
    assert summary["output_tokens_per_s"] > 0 and summary["compiles"] >= 0


def test_crash_resume_skips_done_and_drops_torn_line(engine, reference, tmp_path):
    lines, ref = reference
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    generate_file(engine, inp, out, DEFAULTS, log=io.StringIO())
    full = out.read_text().splitlines(keepends=True)
    torn = full[4][: len(full[4]) // 2]   # a crash in the middle of writing the fifth result
    out.write_text("".join(full[:4]) + torn)
    log = io.StringIO()
    summary = generate_file(engine, inp, out, DEFAULTS, max_queued=2, log=log)
    assert "dropping line 5" in log.getvalue()
    assert summary["skipped_done"] == 4 and summary["requests"] == len(lines) - 4
    results = read_jsonl(out)
    assert sorted(str(r["id"]) for r in results) == sorted(map(str, ref))
    assert all(r["token_ids"] == ref[r["id"]].token_ids for r in results)
    again = generate_file(engine, inp, out, DEFAULTS, log=io.StringIO())
    assert again["requests"] == 0 and again["skipped_done"] == len(lines)


def test_failed_step_leaves_its_lines_for_a_rerun(reference, tmp_path):
    """Requests whose engine step fails get no result and are reported; a re-run completes
    them with the results a clean run gives."""
    lines, ref = reference
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    engine = tiny_engine()
    calls = []

    def fail_third_dispatch(phase, runner):
        calls.append(phase)
        if calls.count("dispatch") == 3 and phase == "dispatch":
            raise RuntimeError("injected fault")

    engine.runner.fault_hook = fail_third_dispatch
    log = io.StringIO()
    first = generate_file(engine, inp, out, DEFAULTS, max_queued=3, log=log)
    assert first["rejected"] >= 1 and "injected fault" in log.getvalue()
    assert len(read_jsonl(out)) == len(lines) - first["rejected"]
    engine.runner.fault_hook = None
    second = generate_file(engine, inp, out, DEFAULTS, log=io.StringIO())
    assert second["requests"] == first["rejected"] and second["rejected"] == 0
    results = read_jsonl(out)
    assert sorted(str(r["id"]) for r in results) == sorted(map(str, ref))
    assert all(r["token_ids"] == ref[r["id"]].token_ids for r in results)


def test_output_not_ours_is_refused(engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, random_prompts(1, seed=4))
    out.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(JaxinferError, match="line 2"):
        generate_file(engine, inp, out, DEFAULTS, log=io.StringIO())


def test_bad_lines_reported_with_line_numbers_and_skipped(engine, tmp_path):
    good = random_prompts(3, seed=5)
    lines = [
        dict(good[0], id="a"),                                   # 1 ok
        '{"prompt_token_ids": [5, 6,',                           # 2 malformed
        dict(good[1], id="b", temprature=0.5),                   # 3 unknown field
        dict(good[1], id="c", top_p=1.5),                        # 4 invalid parameter
        {"prompt_token_ids": [], "id": "d"},                     # 5 empty prompt
        {"prompt_token_ids": [7] * 128, "id": "e"},              # 6 longer than max_model_len
        dict(good[2], id="a"),                                   # 7 duplicate id
        "[1, 2]",                                                # 8 not an object
        {"prompt": "hello", "id": "f"},                          # 9 tiny model: no tokenizer
        dict(good[1], id="g", prompt="x"),                       # 10 two prompt fields
        "",                                                      # 11 blank: ignored
        dict(good[2]),                                           # 12 ok, id line-12
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    log = io.StringIO()
    summary = generate_file(engine, inp, out, DEFAULTS, log=log)
    assert summary["rejected_lines"] == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert sorted(r["id"] for r in read_jsonl(out)) == ["a", "line-12"]
    msgs = log.getvalue()
    for needle in ("line 2: not valid JSON", "line 3: unknown field 'temprature'",
                   "line 4: top_p", "line 5: prompt is empty", "line 6: prompt has 128 tokens",
                   "line 7: duplicate id 'a'", "line 8: must be a JSON object",
                   "line 9: this model has no tokenizer", "line 10: give exactly one of"):
        assert needle in msgs
