"""AsyncLLM: streaming from Python over the engine thread, as vLLM's AsyncLLM.generate.
Concurrent streams of SmolLM2 equal LLM.generate; leaving a stream early or aborting it frees
its pages; bad input raises naming the field."""
import asyncio
import time

import pytest

from jaxinfer import AsyncLLM, LLM, SamplingParams
from jaxinfer.errors import InvalidRequestError

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Name three colors."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with AsyncLLM("smollm2", **ENGINE) as llm:
        yield llm


def _pages_used(llm) -> int:
    return llm.engine.scheduler.allocator.num_used


def _wait_for_no_pages(llm, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _pages_used(llm) == 0 and not llm.engine.scheduler.requests:
            return True
        time.sleep(0.05)
    return False


async def _collect(llm, prompt, params):
    outs = [o async for o in llm.generate(prompt, params)]
    return outs


def test_concurrent_streams_equal_generate(llm):
    async def main():
        return await asyncio.gather(*(_collect(llm, p, GREEDY) for p in PROMPTS))

    streams = asyncio.run(main())
    want = LLM("smollm2", **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    for outs, w in zip(streams, want):
        last = outs[-1]
        assert last.finished and all(not o.finished for o in outs[:-1])
        assert "".join(o.text_delta for o in outs) == last.text == w.text
        assert [t for o in outs for t in o.new_token_ids] == w.token_ids
    assert _wait_for_no_pages(llm)


def test_a_lower_priority_value_passes_the_waiting_queue(llm):
    """Four long requests hold every row; of those that wait behind them, the one with the
    lowest priority value starts first, though it came last."""
    async def main():
        order = []

        async def one(name, priority, max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            async for o in llm.generate(PROMPTS[0], params, priority=priority):
                if o.new_token_ids and name not in order:
                    order.append(name)
        await asyncio.gather(*(one(f"running{i}", 0, 24) for i in range(4)),
                             *(one(f"waiting{i}", 1, 2) for i in range(3)),
                             one("urgent", -1, 2))
        return order

    order = asyncio.run(main())
    assert order.index("urgent") < min(order.index(f"waiting{i}") for i in range(3)), order
    assert _wait_for_no_pages(llm)


def test_generate_takes_one_priority_per_prompt():
    """LLM.generate(priority=[...]), as vLLM's: one row, so the requests run one after the
    other, lowest value first; the answers are those without priorities."""
    llm = LLM("tiny", max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    prompts = [{"prompt_token_ids": [5, 6, i]} for i in (7, 8, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain = llm.generate(prompts, params, use_tqdm=False)
    ranked = llm.generate(prompts, params, use_tqdm=False, priority=[2, 1, 0])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]
    assert ranked[2].latency_s < ranked[1].latency_s < ranked[0].latency_s
    with pytest.raises(InvalidRequestError, match="priority must be a list"):
        llm.generate(prompts, params, priority=[0])


def test_leaving_a_stream_early_aborts_it(llm):
    async def main():
        n = 0
        async for _ in llm.generate(PROMPTS[0], SamplingParams(max_tokens=240,
                                                                ignore_eos=True)):
            n += 1
            if n == 3:
                break
        return n, llm.engine.num_generated

    n, generated = asyncio.run(main())
    assert n == 3 and _wait_for_no_pages(llm)
    assert llm.engine.num_generated - generated < 100     # stopped, not run to 240 tokens


def test_abort_by_id_ends_the_stream_cancelled(llm):
    async def main():
        outs = []
        async for out in llm.generate(PROMPTS[1], SamplingParams(max_tokens=200,
                                                                  ignore_eos=True),
                                      request_id="to-abort"):
            outs.append(out)
            if len(outs) == 2:
                llm.abort("to-abort")
        return outs

    outs = asyncio.run(main())
    assert str(outs[-1].finish_reason) == "cancelled" and len(outs[-1].token_ids) < 200
    assert _wait_for_no_pages(llm)


def test_bad_input_raises_naming_the_field(llm):
    async def main(prompt, params):
        return [o async for o in llm.generate(prompt, params)]

    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(main("", GREEDY))
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(main(PROMPTS[0], {"max_tokens": 0}))
    assert e.value.field == "max_tokens"


def test_n_completions_stream_by_index_then_one_final_output(llm):
    outs = asyncio.run(_collect(llm, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5,
                                                                n=2)))
    *deltas, out = outs
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert not any(d.finished for d in deltas)
    for i in (0, 1):
        joined = [t for d in deltas if d.outputs[0].index == i for t in d.new_token_ids]
        assert joined == out.outputs[i].token_ids


def test_lora_adapters_stream_and_load_at_run_time(tmp_path):
    from checkpoints.synthetic_lora import write_random_adapter
    from jaxinfer.config import EngineConfig, standard_config
    from jaxinfer.engine import Engine

    paths = [write_random_adapter(tmp_path / n, standard_config("tiny"), rank=4, seed=i,
                                  std=0.3) for i, n in enumerate(("a", "b"))]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, max_loras=1)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    with AsyncLLM("tiny", lora_modules=[("a", paths[0])], **kw) as llm:
        async def run():
            await llm.load_lora("b", paths[1])
            got = {n: (await _collect(llm, prompt, SamplingParams(
                temperature=0.0, max_tokens=8, lora=n)))[-1].token_ids for n in ("a", "b")}
            await llm.unload_lora("b")
            with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'b'"):
                await llm.unload_lora("b")
            return got
        got = asyncio.run(run())
        assert llm.engine.lora_names() == ["a"]
    want = Engine.from_model("tiny", EngineConfig(**kw), [("a", paths[0]), ("b", paths[1])])
    for name in ("a", "b"):
        rid = want.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, lora=name))
        assert got[name] == want.run_until_done(use_tqdm=False)[rid].token_ids
    assert got["a"] != got["b"]
