"""Offline batch generation (jaxinfer.batch_generate): results equal the engine run directly,
a crashed run resumes without duplicates, bad lines are reported and skipped; plus one CLI run
with the real model. The OpenAI batch format: SmolLM2's responses equal LLM.generate, bad lines
get 400 results naming the field, a crashed run resumes by custom_id."""
import dataclasses
import io
import os
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_util import random_prompts, tiny_engine
from jaxinfer.batch_generate import generate_file
from jaxinfer.config import EngineConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM
from jaxinfer.openai_protocol import CHAT_URL, COMPLETIONS_URL, FINISH_REASONS
from jaxinfer.request import SamplingParams

DEFAULTS = SamplingParams(temperature=0.0, max_tokens=6)
REPO = Path(__file__).resolve().parents[2]
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


def write_jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                            for ln in lines))


def read_jsonl(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


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


def test_cli_text_prompts_end_to_end(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [{"prompt": "The capital of France is", "id": "fr"},
                      {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}])
    cmd = [sys.executable, "-m", "jaxinfer.cli", "generate", "--input", str(inp),
           "--output", str(out), "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           "--max-model-len", "256", "--max-tokens", "5"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["id"]: r for r in read_jsonl(out)}
    assert set(results) == {"fr", "line-2"}
    fr, chat = results["fr"], results["line-2"]
    assert fr["prompt"] == "The capital of France is" and "prompt" not in chat
    assert 1 <= fr["completion_tokens"] <= 5 and 1 <= chat["completion_tokens"] <= 3
    assert fr["text"].strip() and isinstance(chat["text"], str)
    assert json.loads(proc.stdout)["requests"] == 2


# --- OpenAI batch format ------------------------------------------------------------------
SMOL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", engine_config=EngineConfig(**SMOL_ENGINE))


def batch_line(custom_id, body, url=COMPLETIONS_URL, **kw):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **kw}


def by_custom_id(results):
    return {r["custom_id"]: r for r in results if "custom_id" in r}


def test_openai_batch_matches_llm_generate(llm, tmp_path):
    """Completions (one prompt with logprobs, two prompts) and chat with logprobs, beside a
    jaxinfer-format line in the same file: the same text, tokens and usage as LLM.generate."""
    text, chat = "The capital of France is", [{"role": "user", "content": "What is 2 + 2?"}]
    multi = ["def fibonacci(n):", "Once upon a time"]
    lines = [
        batch_line("cmpl", {"model": "anything", "prompt": text, "max_tokens": 6,
                            "temperature": 0, "logprobs": 2}),
        {"id": "plain", "prompt": text, "max_tokens": 6},
        batch_line("multi", {"prompt": multi, "max_tokens": 5, "temperature": 0}),
        batch_line("chat", {"messages": chat, "max_tokens": 6, "temperature": 0,
                            "logprobs": True, "top_logprobs": 2}, url=CHAT_URL),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    summary = generate_file(llm.engine, inp, out, DEFAULTS, log=io.StringIO())
    greedy_lp = dataclasses.replace(DEFAULTS, logprobs=2)
    ref_cmpl, ref_chat, *ref_multi = llm.generate(
        [text, chat] + multi, [greedy_lp, greedy_lp] + [dataclasses.replace(DEFAULTS,
                                                                             max_tokens=5)] * 2,
        use_tqdm=False)
    tok = llm.tokenizer
    results = read_jsonl(out)
    batch = by_custom_id(results)
    assert set(batch) == {"cmpl", "multi", "chat"} and len(results) == 4
    for r in batch.values():
        resp = r["response"]
        assert re.fullmatch(r"batch_req_[0-9a-f]{32}", r["id"]) and r["error"] is None
        assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
        assert resp["body"]["model"] == "smollm2"

    plain = next(r for r in results if r.get("id") == "plain")
    assert plain["text"] == ref_cmpl.text and plain["token_ids"] == ref_cmpl.token_ids

    body = batch["cmpl"]["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (c,) = body["choices"]
    assert c["text"] == ref_cmpl.text and ref_cmpl.text.strip()
    assert c["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ref_cmpl.prompt_token_ids),
                             "completion_tokens": 6,
                             "total_tokens": len(ref_cmpl.prompt_token_ids) + 6}
    lp = c["logprobs"]
    texts = [tok.decode([t], skip_special_tokens=False) for t in ref_cmpl.token_ids]
    assert lp["tokens"] == texts and "".join(texts) == c["text"]
    np.testing.assert_allclose(lp["token_logprobs"],
                               [d[t].logprob for t, d in zip(ref_cmpl.token_ids, ref_cmpl.logprobs)],
                               atol=1e-5)
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in texts[:-1]]))
    assert [len(top) for top in lp["top_logprobs"]] == [2] * 6
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == p for top, p in zip(lp["top_logprobs"],
                                                          lp["token_logprobs"]))

    body = batch["multi"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [o.text for o in ref_multi]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in ref_multi)
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in ref_multi)

    body = batch["chat"]["response"]["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (c,) = body["choices"]
    assert c["message"] == {"role": "assistant", "content": ref_chat.text}
    assert c["finish_reason"] == FINISH_REASONS[ref_chat.finish_reason]
    assert body["usage"]["completion_tokens"] == len(ref_chat.token_ids)
    assert body["usage"]["prompt_tokens"] == len(ref_chat.prompt_token_ids)
    content = c["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.decode([t], skip_special_tokens=False)
                                             for t in ref_chat.token_ids]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode())
               for e in content)

    assert summary["requests"] == 4 and summary["rejected"] == 0
    assert summary["output_tokens"] == 6 + 6 + len(ref_chat.token_ids) + sum(
        len(o.token_ids) for o in ref_multi)


def test_openai_batch_bad_lines_get_400_results(engine, tmp_path):
    ids = random_prompts(2, seed=6)
    ok = {"prompt": ids[0]["prompt_token_ids"], "max_tokens": 2}
    lines = [
        batch_line("ok", ok),                                                  # 1
        batch_line("get", ok, method="GET"),                                   # 2
        batch_line("emb", ok, url="/v1/embeddings"),                           # 3
        batch_line("type", {**ok, "max_tokens": "2"}),                         # 4
        batch_line("stream", {**ok, "stream": True}),                          # 5
        batch_line("ok", ok),                                                  # 6 duplicate
        batch_line("long", {"prompt": [ids[1]["prompt_token_ids"], [7] * 128]}),  # 7
        batch_line("msg", {"messages": [{"role": "user"}]}, url=CHAT_URL),     # 8
        {"custom_id": "nobody", "method": "POST", "url": COMPLETIONS_URL},     # 9
        batch_line("extra", ok, metadata={}),                                  # 10
        batch_line(7, ok),                                                     # 11 stderr only
        {"custom_id": "", "prompt": "x"},                                      # 12 stderr only
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    log = io.StringIO()
    summary = generate_file(engine, inp, out, DEFAULTS, log=log)
    assert summary["rejected_lines"] == list(range(2, 13)) and summary["requests"] == 1
    results = read_jsonl(out)
    assert len(results) == 10   # one per line with a usable custom_id
    params = {}
    for r in results:
        if r["response"]["status_code"] == 200:
            assert r["custom_id"] == "ok"
            continue
        assert r["response"]["status_code"] == 400 and r["response"]["request_id"] is None
        err = r["response"]["body"]["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value"
        assert err["message"].startswith(err["param"] + ": ")
        params[r["custom_id"]] = err["param"]
    assert params == {"get": "method", "emb": "url", "type": "body.max_tokens",
                      "stream": "body.stream", "ok": "custom_id", "long": "body.prompt[1]",
                      "msg": "body.messages[0].content", "nobody": "body", "extra": "metadata"}
    msgs = log.getvalue()
    for needle in ("line 2: method: must be 'POST', got 'GET'; wrote its 400 result",
                   "line 3: url: must be", "line 6: custom_id: 'ok' is a duplicate",
                   "line 7: body.prompt[1]: prompt has 128 tokens",
                   "line 11: custom_id must be a non-empty string, got 7; skipped",
                   "line 12: custom_id must be"):
        assert needle in msgs
    assert not engine.has_unfinished_requests()   # the long line's first prompt was taken back


def result_key(r):
    """(id or custom_id, status code: None for a jaxinfer-format result)."""
    if "custom_id" in r:
        return r["custom_id"], r["response"]["status_code"]
    return r["id"], None


def answer(r):
    """What two runs of a line have in common: not the ids or `created`, and logprobs only
    to float32 precision (they move by an ulp with the batch's composition)."""
    if "custom_id" not in r:
        return r["token_ids"]
    body = r["response"]["body"]
    if "error" in body:
        return body["error"]
    choices = [{**c, "logprobs": c["logprobs"] and {
        **c["logprobs"], "token_logprobs": np.round(c["logprobs"]["token_logprobs"], 4).tolist()}}
               for c in body["choices"]]
    return choices, body["usage"]


def test_openai_batch_crash_resume(engine, tmp_path):
    """A crash tore the output's last line, after the 400 result of a repeated custom_id but
    before the first line with that custom_id finished: the rerun writes each missing result
    once and nothing twice."""
    prompts = [p["prompt_token_ids"] for p in random_prompts(5, seed=7)]
    lines = [batch_line("a", {"prompt": prompts[0], "max_tokens": 8, "temperature": 0}),
             batch_line("b", {"prompt": prompts[1:3], "max_tokens": 3, "temperature": 0,
                              "logprobs": 0}),
             {"prompt_token_ids": prompts[3], "id": "p"},
             batch_line("c", {"prompt": prompts[4], "max_tokens": 2, "temperature": 0}),
             batch_line("a", {"prompt": prompts[0]}),                    # a repeat: a 400
             batch_line("d", {"prompt": prompts[4]}, url="/v1/nope")]    # a 400
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    first = generate_file(engine, inp, out, DEFAULTS, log=io.StringIO())
    assert first["requests"] == 4 and first["rejected_lines"] == [5, 6]
    full = {result_key(json.loads(ln)): ln for ln in out.read_text().splitlines(keepends=True)}
    assert set(full) == {("a", 200), ("b", 200), ("p", None), ("c", 200), ("a", 400),
                         ("d", 400)}
    torn = full["b", 200][:len(full["b", 200]) // 2]
    out.write_text(full["a", 400] + full["c", 200] + full["d", 400] + torn)
    log = io.StringIO()
    summary = generate_file(engine, inp, out, DEFAULTS, max_queued=1, log=log)
    assert "dropping line 4" in log.getvalue()
    assert summary["skipped_done"] == 3 and summary["requests"] == 3
    assert summary["rejected"] == 0
    results = {result_key(r): r for r in read_jsonl(out)}
    assert len(read_jsonl(out)) == len(results) == len(lines)
    assert {k: answer(r) for k, r in results.items()} == {
        k: answer(json.loads(ln)) for k, ln in full.items()}
    again = generate_file(engine, inp, out, DEFAULTS, log=io.StringIO())
    assert again["requests"] == 0 and again["skipped_done"] == len(lines)
    assert len(read_jsonl(out)) == len(lines)
