"""Tokenizer: ids and chat template agree with HF transformers' GGUF tokenizer; the incremental
detokenizer never emits broken UTF-8 and adds up to `decode`."""
import json

import gguf
import numpy as np
import pytest

from checkpoints import default_gguf_path
from checkpoints.gguf_tokenizer import gguf_tokenizer
from jaxinfer.errors import ConfigError, ModelLoadError
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing  ",
    "Numbers 2024 and 3.14159, x=12345678",
    "héllo wörld — naïve café",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "日本語のテキスト 中文 한국어",
    "line one\nline two\n\n\ttabbed\r\n",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "it's they're we'll I'd",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


@pytest.fixture(scope="module")
def tok():
    return gguf_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_special_ids(tok):
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.vocab_size == 49152
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("hi")[0] != tok.bos_token_id  # the GGUF says add_bos_token = false


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_hf(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_hf(tok, hf_tok, chat):
    for gen in (True, False):
        ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
        assert ours == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert tok.encode(ours) == hf_tok.encode(ours)
    assert ours.startswith("<|im_start|>")
    assert tok.encode_chat(chat) == hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                               return_dict=False)


def _stream(tok, prompt_ids, ids, chunks):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas, start = [], 0
    for n in chunks:
        deltas.append(detok.add(ids[start:start + n]))
        start += n
    deltas.append(detok.add(ids[start:]))
    deltas.append(detok.flush())
    return deltas


def test_detokenizer_holds_back_split_characters(tok):
    text = "Café 😀👍🏽 日本語 — ok 🇫🇷!"
    ids = tok.encode(text)
    assert "\ufffd" in tok.decode(ids[:6])  # some characters really are split across tokens
    deltas = _stream(tok, np.array(tok.encode("Say:")), ids, [1] * len(ids))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_detokenizer_random_chunks_and_special_tokens(tok):
    rng = np.random.default_rng(0)
    ids = tok.encode("ünïcödé 🙂 text with <|im_end|> inside 中文") + [2]
    for _ in range(5):
        chunks = list(rng.integers(0, 4, size=len(ids)))
        deltas = _stream(tok, [], ids, chunks)
        assert "".join(deltas) == tok.decode(ids)
        assert "<|im_end|>" not in "".join(deltas)


def test_detokenizer_flush_emits_unfinished_character(tok):
    ids = tok.encode("a 😀")
    detok = IncrementalDetokenizer(tok, [])
    held = [detok.add([i]) for i in ids[:-1]]
    assert "".join(held) + detok.flush() == tok.decode(ids[:-1])


def test_to_dir_from_dir_and_from_file(tok, tmp_path):
    tok.to_dir(tmp_path / "saved")
    again = Tokenizer.from_dir(tmp_path / "saved")
    (tmp_path / "hf").mkdir()
    tok.backend.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": "<|im_start|>",
         "eos_token": {"content": "<|im_end|>"}}))
    from_file = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    for other in (again, from_file):
        assert [other.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
        assert other.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])
        assert (other.bos_token_id, other.eos_token_ids) == (tok.bos_token_id, tok.eos_token_ids)
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json").eos_token_ids == (2, 0)


def test_errors(tok, tmp_path):
    bare = Tokenizer(tok.backend)
    with pytest.raises(ConfigError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(ModelLoadError, match="no saved tokenizer"):
        Tokenizer.from_dir(tmp_path)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="only byte-level BPE"):
        gguf_tokenizer(tmp_path / "spm.gguf")
