"""Bad input gets a clear error naming the problem, never a traceback from deep inside JAX."""
import subprocess
import sys

import jax
import pytest

from checkpoints import load_checkpoint
from engine_util import tiny_engine
from jaxinfer import runner
from jaxinfer.config import EngineConfig, standard_config
from jaxinfer import LLM, SamplingParams
from jaxinfer.cli import main
from jaxinfer.errors import ConfigError, InvalidRequestError, InvalidTypeError, ModelLoadError


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no model at"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_checkpoint(bad)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt2'"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"top_k": 2**31}, "top_k"),
    ({"temperature": float("inf")}, "temperature"),
    ({"stop_token_ids": (True,)}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([""])


def test_prompt_longer_than_context(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len is 64"):
        llm.generate(["word " * 100])


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2, 10**6]}])


def test_max_model_len_beyond_the_model():
    with pytest.raises(ConfigError, match="context length 2048"):
        LLM("tiny", max_model_len=4096)


def test_cli_reports_errors_without_traceback(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "temperature must be >= 0" in err and "Traceback" not in err
    assert main(["generate", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    assert "no model at" in capsys.readouterr().err


def test_cli_help_explains():
    out = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--chat",
                 "--model", "--input", "--output"):
        assert flag in out


def test_stop_token_ids_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=(10**6,)))


def test_model_without_tokenizer_rejects_text_and_stop_strings():
    llm = LLM("tiny", max_model_len=64, max_num_seqs=1)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(stop=["x"]))


def test_bad_prompt_leaves_nothing_queued(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""])
    assert not llm.engine.has_unfinished_requests()


def test_num_pages_too_small():
    with pytest.raises(ConfigError, match="num_pages"):
        LLM("tiny", num_pages=1)


def _exhausted(*_a, **_k):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                     "allocate 46.88GiB")


def test_kv_pool_out_of_memory_names_the_pool(monkeypatch):
    monkeypatch.setattr(runner, "allocate_kv", _exhausted)
    with pytest.raises(ConfigError, match=r"allocating the KV cache ran out of device memory "
                                          r"next to a KV pool of 257 pages \(0\.0 GiB\): "
                                          r"lower num_pages.*XLA said: RESOURCE_EXHAUSTED"):
        tiny_engine()


def test_warmup_out_of_memory_names_the_pool(monkeypatch):
    engine = tiny_engine(max_num_seqs=2, max_num_batched_tokens=16)
    monkeypatch.setattr(runner.ModelRunner, "step", _exhausted)
    with pytest.raises(ConfigError, match="a warm-up step ran out of device memory"):
        engine.warmup(progress=False, variants=("plain",))


def test_compile_out_of_memory_names_the_pool(monkeypatch):
    """The autotuner's trial buffers not fitting beside the pool: the same clear error."""
    engine = tiny_engine(max_num_seqs=2, max_num_batched_tokens=16)
    monkeypatch.setattr(runner.ModelRunner, "compile_ahead", _exhausted)
    with pytest.raises(ConfigError, match=r"compiling the steps ran out of device memory next "
                                          r"to a KV pool of \d+ pages.*lower num_pages"):
        engine.warmup(progress=False, variants=("plain",))


def test_other_runtime_errors_pass_through(monkeypatch):
    def broken(*_a, **_k):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
    monkeypatch.setattr(runner, "allocate_kv", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        tiny_engine()


def test_kv_pool_size():
    # Llama-3-8B, FP8 KV, 96,001 pages of 16: K and V 46.88 GiB each (the allocation
    # _exhausted fails) plus, with per-token scales, two f32 scale arrays (static scales:
    # [L, K] for the whole pool, not counted per page)
    cfg = EngineConfig(page_size=16, num_pages=96001, max_model_len=2001, max_num_seqs=768,
                       kv_dtype="fp8", dtype="bfloat16", kv_scales="token")
    k = 32 * 8 * 96001 * 16 * 128 / 2 ** 30
    llama = standard_config("llama-3-8b")
    assert runner.kv_pool_gib(llama, cfg) == pytest.approx(2 * k * (1 + 4 / 128))
    assert runner.kv_pool_gib(llama, cfg.replace(kv_scales="static")) == pytest.approx(2 * k)


@pytest.mark.parametrize("call, field", [
    (lambda llm: llm.generate(None), "prompts"),
    (lambda llm: llm.generate(42), "prompts"),
    (lambda llm: llm.generate("Hi", "greedy"), "sampling_params"),
    (lambda llm: llm.generate("Hi", [{"max_tokens": 2}, 7]), "sampling_params[1]"),
    (lambda llm: llm.generate([None]), "prompt"),
    (lambda llm: SamplingParams(stop=5), "stop"),
    (lambda llm: SamplingParams(stop=[b"x"]), "stop"),
    (lambda llm: SamplingParams(stop_token_ids="12"), "stop_token_ids"),
    (lambda llm: SamplingParams(max_tokens="8"), "max_tokens"),
    (lambda llm: SamplingParams(temperature=None), "temperature"),
    (lambda llm: SamplingParams(seed=1.5), "seed"),
    (lambda llm: SamplingParams(ignore_eos="yes"), "ignore_eos"),
])
def test_python_api_type_errors_name_the_field(llm, call, field):
    """A wrong type is a TypeError that is also our InvalidRequestError, naming the field."""
    with pytest.raises(InvalidTypeError) as e:
        call(llm)
    assert isinstance(e.value, TypeError) and isinstance(e.value, InvalidRequestError)
    assert e.value.field == field and field in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_from_a_dict(llm):
    """A dict of SamplingParams fields works where SamplingParams does; an unknown key is
    named."""
    [a] = llm.generate("The capital of France is", {"max_tokens": 3, "temperature": 0.0},
                       use_tqdm=False)
    [b] = llm.generate("The capital of France is", SamplingParams(max_tokens=3, temperature=0.0),
                       use_tqdm=False)
    assert a.token_ids == b.token_ids
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("Hi", {"max_token": 3})
    assert e.value.field == "max_token"


def test_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    step, calls = llm.engine.step, []

    def interrupted(**kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step(**kw)

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["The capital of France is", "Hello"], SamplingParams(max_tokens=8),
                     use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.scheduler.has_unfinished
    assert llm.engine.scheduler.allocator.num_used == 0
