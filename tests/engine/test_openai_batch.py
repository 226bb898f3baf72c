"""The OpenAI batch format through the offline batch script (jaxinfer.openai_batch,
jaxinfer.batch_generate): SmolLM2's responses equal LLM.generate, bad lines get 400 results
naming the field, a crashed run resumes by custom_id."""
import dataclasses
import io
import json
import re

import numpy as np
import pytest

from engine_util import random_prompts, read_jsonl, tiny_engine, write_jsonl
from jaxinfer.batch_generate import generate_file
from jaxinfer.config import EngineConfig
from jaxinfer.llm import LLM
from jaxinfer.openai_protocol import CHAT_URL, COMPLETIONS_URL, FINISH_REASONS
from jaxinfer.request import SamplingParams

DEFAULTS = SamplingParams(temperature=0.0, max_tokens=6)
SMOL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


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
