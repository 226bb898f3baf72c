"""Text out of the engine on the real model: streamed deltas join to the final text and to
decode(token_ids) (multi-byte characters split across tokens included), and stop strings end
the request with the text cut before them."""
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.request import FinishReason

CHAT = [{"role": "user", "content":
         "Write the word 'hello' in Chinese characters, Japanese and with an emoji."}]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)


def stream(engine, prompt, params):
    engine.add_request(prompt, params)
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.text_delta)
            last = o
    return "".join(deltas), last


def test_deltas_join_to_text_and_decode_with_multibyte_output(llm):
    joined, last = stream(llm.engine, CHAT, SamplingParams(temperature=0.0, max_tokens=40))
    assert any(ord(c) > 0x2FFF for c in last.text), "the prompt no longer yields CJK/emoji"
    # LLM.generate steps without deltas, decoding the text once at the end: the same text.
    [whole] = llm.generate([CHAT], SamplingParams(temperature=0.0, max_tokens=40),
                           use_tqdm=False)
    assert whole.text == joined == last.text and whole.token_ids == last.token_ids
    # Only a character cut by max_tokens may end as U+FFFD (decode() says the same).
    assert "\ufffd" not in joined.rstrip("\ufffd")
    assert joined == last.text == llm.tokenizer.decode(last.token_ids)


def test_stop_string_ends_the_request_and_is_cut(llm):
    free = llm.generate([CHAT], SamplingParams(temperature=0.0, max_tokens=40),
                        use_tqdm=False)[0]
    stop = free.text[10:13]          # three characters from inside the free-running answer
    cut = free.text.index(stop)
    joined, last = stream(llm.engine, CHAT, SamplingParams(temperature=0.0, max_tokens=40,
                                                           stop=["zzzq", stop]))
    assert last.finish_reason == FinishReason.STOP
    assert joined == last.text == free.text[:cut]
    assert len(last.token_ids) < len(free.token_ids)


def test_chat_and_outputs_in_vllm_shape(llm):
    """LLM.chat answers a conversation (or several) as generate does; RequestOutput.outputs
    holds it as vLLM's CompletionOutput, its logprobs as vLLM's Logprob."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    [want] = llm.generate([CHAT], params, use_tqdm=False)
    [one] = llm.chat(CHAT, params, use_tqdm=False)
    two = llm.chat([CHAT, CHAT], params, use_tqdm=False)
    assert one.token_ids == want.token_ids == two[0].token_ids == two[1].token_ids
    [c] = one.outputs
    assert (c.index, c.text, c.token_ids, c.finish_reason) == (
        0, one.text, one.token_ids, str(one.finish_reason))
    assert c.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(one.logprobs, one.token_ids)))
    assert c.cumulative_logprob < 0
    tok = llm.engine.tokenizer         # each Logprob as vLLM's: greedy picks rank 1
    for d, t in zip(one.logprobs, one.token_ids):
        assert (d[t].rank, d[t].decoded_token) == (1, tok.decode([t], skip_special_tokens=False))
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[
        0].cumulative_logprob is None


def test_n_greedy_completions_of_the_real_model(llm):
    """n = 2 through LLM.generate: two completions, each the single greedy answer."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    [want] = llm.generate("The capital of France is", params, use_tqdm=False)
    [got] = llm.generate("The capital of France is", SamplingParams(
        temperature=0.0, max_tokens=6, n=2), use_tqdm=False)
    assert [(c.index, c.text, c.token_ids) for c in got.outputs] == [
        (i, want.text, want.token_ids) for i in range(2)]


def test_beam_search_top_beam_is_at_least_as_likely_as_greedy(llm):
    from jaxinfer import BeamSearchParams

    prompt = "The capital of France is"
    [greedy] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0,
                                                   ignore_eos=True), use_tqdm=False)
    greedy_logprob = greedy.outputs[0].cumulative_logprob
    [out] = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6,
                                                     ignore_eos=True))
    top = out.sequences[0]
    assert len(out.sequences) == 3
    assert top.cum_logprob >= greedy_logprob - 1e-4
    assert [s.cum_logprob for s in out.sequences] == sorted(
        (s.cum_logprob for s in out.sequences), reverse=True)
    assert top.text == llm.tokenizer.decode(top.tokens[len(greedy.prompt_token_ids):])
