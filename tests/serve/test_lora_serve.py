"""LoRA adapters through a real SmolLM2 server subprocess (`--lora`, `--allow-runtime-lora`):
the official `openai` client names an adapter as its model, the gRPC client in
SamplingParams.lora; adapters load and unload at run time over both; every answer equals
LLM.generate with the same adapter (whose outputs test_lora_hf.py checks against peft)."""
import grpc
import openai
import pytest

from checkpoints import load_checkpoint
from checkpoints.synthetic_lora import write_random_adapter
from http_util import call, metrics
from jaxinfer import LLM, SamplingParams
from serve.client import Client
from serve.launcher import ServerProcess

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, dtype="float32",
              max_loras=2, max_lora_rank=8)
ARGS = ["--model", "smollm2", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--max-model-len", "256", "--dtype", "float32", "--max-loras", "2",
        "--max-lora-rank", "8"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    cfg = load_checkpoint("smollm2")[0]
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_random_adapter(root / name, cfg, rank=r, seed=seed, std=0.06,
                                       modules=modules)
            for name, r, seed, modules in (("terse", 8, 1, ("q", "v", "o")),
                                           ("wordy", 4, 2, ("gate", "up", "down")),
                                           ("late", 8, 3, ("k", "v", "down")))}


@pytest.fixture(scope="module")
def server(adapters):
    with ServerProcess([*ARGS, "--http-port", "0", "--lora", f"terse={adapters['terse']}",
                       "--lora", f"wordy={adapters['wordy']}", "--allow-runtime-lora"]) as srv:
        srv.wait_serving(timeout=300)
        yield srv


@pytest.fixture(scope="module")
def llm(adapters):
    return LLM("smollm2", lora_modules=list(adapters.items()), **ENGINE)


def greedy(**kw):
    return SamplingParams(max_tokens=12, temperature=0.0, **kw)


_ANSWERS: dict = {}     # (prompts, adapter) -> the LLM's greedy texts: each asked once


def want(llm, prompts, lora):
    key = (tuple(prompts), lora)
    if key not in _ANSWERS:
        _ANSWERS[key] = [o.text for o in llm.generate(prompts, greedy(lora=lora),
                                                      use_tqdm=False)]
    return _ANSWERS[key]


def test_the_openai_client_names_an_adapter_as_its_model(server, llm):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        for model, lora in (("smollm2", None), ("terse", "terse"), ("wordy", "wordy")):
            got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12,
                                            temperature=0)
            assert got.model == model
            assert [c.text for c in got.choices] == want(llm, PROMPTS, lora), model
        chat = [{"role": "user", "content": "Name three colors."}]
        stream = client.chat.completions.create(model="terse", messages=chat, max_tokens=12,
                                                temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == llm.chat(chat, greedy(lora="terse"), use_tqdm=False)[0].text
        assert len({tuple(want(llm, PROMPTS, a)) for a in (None, "terse", "wordy")}) == 3
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"smollm2", "terse", "wordy"}
        assert cards["terse"].parent == "smollm2" and cards["terse"].root.endswith("terse")
        with pytest.raises(openai.NotFoundError, match="'terse' and 'wordy'|terse"):
            client.completions.create(model="nope", prompt="x", max_tokens=2)
    m = metrics(server.http_url + "/metrics")
    assert m["jaxinfer_lora_output_tokens_total{terse}"] >= 12 + 2 * 12
    assert m["jaxinfer_lora_requests_total{wordy}"] >= 1
    assert m["jaxinfer_lora_adapters_loaded"] == 2


def test_adapters_load_and_unload_over_http_at_run_time(server, llm, adapters):
    url = server.http_url
    status, text = call(url + "/v1/load_lora_adapter",
                        {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert status == 200 and "late" in text
    status, body = call(url + "/v1/completions", {"model": "late", "prompt": PROMPTS[0],
                                                  "max_tokens": 12, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == want(llm, PROMPTS[:1], "late")[0]
    status, body = call(url + "/v1/load_lora_adapter",
                        {"lora_name": "bad", "lora_path": str(adapters["late"] / "missing")})
    assert status == 400 and body["error"]["param"] == "lora_path"
    assert "adapter_config.json not found" in body["error"]["message"]
    status, body = call(url + "/v1/load_lora_adapter", {"lora_name": "late",
                                                        "lora_path": str(adapters["late"])})
    assert status == 400 and body["error"]["param"] == "lora_name"    # already loaded
    status, _ = call(url + "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200
    status, body = call(url + "/v1/completions", {"model": "late", "prompt": "x",
                                                  "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = call(url + "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 400 and body["error"]["param"] == "lora_name"
    status, body = call(url + "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["error"]["param"] == "lora_path"


def test_grpc_names_adapters_and_loads_them_at_run_time(server, llm, adapters):
    with Client(server.target) as c:
        got = c.complete(PROMPTS[1], {"max_tokens": 12, "temperature": 0.0, "lora": "wordy"})
        assert got.text == want(llm, PROMPTS[1:], "wordy")[0]
        assert list(c.model_info().lora_adapters) == ["terse", "wordy"]
        assert c.load_lora_adapter("late", adapters["late"]) == ["terse", "wordy", "late"]
        got = c.complete(PROMPTS[0], {"max_tokens": 12, "temperature": 0.0, "lora": "late"})
        assert got.text == want(llm, PROMPTS[:1], "late")[0]
        assert c.unload_lora_adapter("late") == ["terse", "wordy"]
        with pytest.raises(grpc.RpcError) as e:
            c.complete(PROMPTS[0], {"max_tokens": 2, "lora": "late"})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("lora: ")
        with pytest.raises(grpc.RpcError) as e:
            c.load_lora_adapter("big", adapters["late"] / "nowhere")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("lora_path: ")
