"""The engine against the independent oracle: Hugging Face transformers loading the same GGUF.

Greedy outputs must be token-identical, and our fp32 logits within 1e-3 of HF's at every step
of prefill and decode, with pages of 4 tokens so every sequence crosses many page boundaries.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import default_gguf_path, load_checkpoint
from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig
from checkpoints.model_state import build_model
from jaxinfer.runner import ModelRunner
from jaxinfer.kv_cache import single_sequence_metadata as single_sequence_md

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
]
NEW_TOKENS = 32
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def hf():
    import torch          # here, not at the top: every xdist worker imports each test file
    import transformers   # to collect it, and only the one running this file needs them

    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model.eval()
    return torch, model, tok


_HF_CACHE = {}


def hf_greedy(hf, ids):
    key = tuple(ids)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_greedy(hf, ids)
    return _HF_CACHE[key]


def _hf_greedy(hf, ids):
    """HF's greedy continuation (raw argmax, EOS not suppressed: `generate` with
    min_new_tokens would mask it) and its logits for every position [len(ids)+NEW-1, V]."""
    torch, model, _ = hf
    full = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            full.append(int(model(torch.tensor([full])).logits[0, -1].argmax()))
        logits = model(torch.tensor([full[:-1]])).logits[0].numpy()
    return full[len(ids):], logits


@pytest.fixture(scope="module")
def ours():
    cfg, flat, tok = load_checkpoint("smollm2", dtype=jnp.float32)
    graphdef, params = build_model(cfg, flat, jnp.float32)
    return cfg, graphdef, params, tok


def test_tokenizer_agrees_with_hf(hf, ours):
    tok = ours[3]
    for p in PROMPTS:
        assert tok.encode(p) == hf[2].encode(p), p


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_hf_at_every_prefill_and_decode_step(hf, ours, prompt):
    cfg, graphdef, params, tok = ours
    ids = tok.encode(prompt)
    hf_tokens, hf_logits = hf_greedy(hf, ids)
    engine = EngineConfig(page_size=PAGE_SIZE, max_model_len=128, max_num_seqs=1)
    runner = ModelRunner(cfg, engine, graphdef, params)
    pages = list(range(1, engine.total_pages))[::-1]  # descending: the page table matters
    got = [runner.all_logits(ids, single_sequence_md(range(len(ids)), pages, PAGE_SIZE,
                                                     engine.pages_per_seq))]
    seq = list(ids)
    for _ in range(NEW_TOKENS - 1):
        seq.append(int(np.argmax(got[-1][-1])))
        got.append(runner.all_logits(seq[-1:], single_sequence_md(
            [len(seq) - 1], pages, PAGE_SIZE, engine.pages_per_seq)))
    seq.append(int(np.argmax(got[-1][-1])))
    got = np.concatenate(got)
    assert seq[len(ids):] == hf_tokens
    assert got.shape == hf_logits.shape
    diff = np.abs(got - hf_logits).max()
    print(f"{prompt!r}: max |logit - HF logit| = {diff:.2e} over {len(got)} positions")
    assert diff <= 1e-3


def test_engine_greedy_is_token_identical_to_hf(hf, ours):
    llm = LLM("smollm2", page_size=PAGE_SIZE, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = ours[3].encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.token_ids == hf_greedy(hf, ids)[0], prompt
    assert "Paris" in outs[0].text


def test_prompt_logprobs_match_hf(hf, ours):
    """SamplingParams.prompt_logprobs: each prompt token's logprob, rank and the top 5 there
    equal HF's log-softmax of its logits, with prompts split over chunked prefill steps."""
    llm = LLM("smollm2", dtype="float32", page_size=PAGE_SIZE, max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1,
                                                prompt_logprobs=5), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        logits = hf_greedy(hf, ids)[1][:len(ids) - 1].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[:, None] \
            - logits.max(-1, keepdims=True)
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None, prompt
        for p in range(1, len(ids)):
            d, row = entries[p], logp[p - 1]
            assert abs(d[ids[p]].logprob - row[ids[p]]) <= 2e-3, (prompt, p)
            t = ids[p]
            assert (row > row[t] + 2e-3).sum() + 1 <= d[t].rank <= (row >= row[t] - 2e-3).sum()
            assert d[t].decoded_token == ours[3].token_text(t)
            top = {u: lp.logprob for u, lp in d.items() if lp.rank <= 5}
            assert len(top) == 5
            fifth = np.sort(row)[-5]
            for u, lp in top.items():   # HF's top 5, up to ties within the tolerance
                assert abs(lp - row[u]) <= 2e-3 and row[u] >= fifth - 2e-3, (prompt, p, u)
