"""Speculative decoding through a real SmolLM2 server subprocess
(`--num-speculative-tokens`): streams that carry several tokens a step over gRPC and the
OpenAI-compatible HTTP API (the official `openai` client) hold exactly the answers of a run
without speculation, and /metrics counts proposals and kept tokens."""
import openai
import pytest

from http_util import metrics
from jaxinfer import LLM, SamplingParams
from serve.client import Client
from serve.launcher import ServerProcess

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, dtype="float32")
ARGS = ["--model", "smollm2", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--max-model-len", "512", "--dtype", "float32", "--num-speculative-tokens", "3"]
QUOTE = [{"role": "user", "content": "Repeat this text exactly:\n\nOne ring to rule them all, "
                                     "one ring to find them, one ring to bring them all and "
                                     "in the darkness bind them."}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess([*ARGS, "--http-port", "0"]) as srv:
        srv.wait_serving(timeout=300)
        yield srv


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", **ENGINE)


def test_streams_hold_the_answers_of_a_run_without_speculation(server, llm):
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    want = llm.chat(QUOTE, greedy, use_tqdm=False)[0]
    before = metrics(server.http_url + "/metrics")
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        stream = client.chat.completions.create(model="smollm2", messages=QUOTE, max_tokens=40,
                                                temperature=0, stream=True)
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(chunks) == want.text
        got = client.completions.create(model="smollm2", prompt="The capital of France is",
                                        max_tokens=8, temperature=0, logprobs=2)
        plain = llm.generate(["The capital of France is"],
                             SamplingParams(max_tokens=8, temperature=0.0, logprobs=2),
                             use_tqdm=False)[0]
        assert got.choices[0].text == plain.text
        assert len(got.choices[0].logprobs.tokens) == len(plain.token_ids)
    m = metrics(server.http_url + "/metrics")
    kept = (m["jaxinfer_spec_decode_num_accepted_tokens_total"]
            - before.get("jaxinfer_spec_decode_num_accepted_tokens_total", 0))
    assert kept > 5 and m["jaxinfer_spec_decode_num_drafts_total"] > 0
    assert m["jaxinfer_spec_decode_num_accepted_tokens_per_pos_total{0}"] > 0
    # Every token counted once, several a step.
    assert (m["jaxinfer_output_tokens_total"] - before["jaxinfer_output_tokens_total"]
            == len(want.token_ids) + len(plain.token_ids))
    # Fewer chunks than tokens: the kept proposals arrive together.
    assert len([c for c in chunks if c]) < len(want.token_ids)
    with Client(server.target) as c:
        g = c.complete(list(want.prompt_token_ids), {"max_tokens": 40, "temperature": 0.0},
                       timeout=120)
    assert g.token_ids == want.token_ids
