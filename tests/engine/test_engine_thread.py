"""EngineThread (jaxinfer/engine_thread.py): a step's outputs reach their asyncio loops in
one hand-off per loop, in order, and plain sinks still get theirs."""
import asyncio
import threading

from engine_util import random_prompts, tiny_engine

from jaxinfer.engine_thread import EngineThread, LoopSink
from jaxinfer.request import SamplingParams


class CountingLoop:
    """An asyncio loop's call_soon_threadsafe, counted."""

    def __init__(self, loop):
        self.loop, self.calls = loop, 0

    def call_soon_threadsafe(self, fn, *args):
        self.calls += 1
        return self.loop.call_soon_threadsafe(fn, *args)


def test_a_steps_outputs_reach_each_loop_in_one_hand_off_in_order():
    thread = EngineThread(tiny_engine, max_waiting=100)
    thread.start()
    thread.ready.wait()
    assert thread.error is None
    prompts = random_prompts(8, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain, plain_done = [], threading.Event()

    def plain_sink(item):
        plain.append(item)
        if item.finished:
            plain_done.set()

    async def run():
        counted = CountingLoop(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in prompts]
        for i, (prompt, q) in enumerate(zip(prompts, queues)):
            assert thread.submit(f"r{i}", prompt, params,
                                 LoopSink(counted, q.put_nowait))
        assert thread.submit("plain", prompts[0], params, plain_sink)
        streams = []
        for q in queues:
            items = [await q.get()]
            while not items[-1].finished:
                items.append(await q.get())
            streams.append(items)
        return counted.calls, streams

    try:
        calls, streams = asyncio.run(run())
        assert plain_done.wait(60)
        steps = thread.engine.num_steps
    finally:
        thread.stop()
    # 8 requests x 6 tokens: at most one hand-off a step, not one an output
    assert all(len(s) == 6 for s in streams)
    assert calls <= steps and calls < 48 / 2, (calls, steps)
    for s in streams:   # each stream in order: its deltas add up to its answer
        assert [t for o in s for t in o.new_token_ids] == s[-1].outputs[0].token_ids
    assert plain[-1].outputs[0].token_ids == streams[0][-1].outputs[0].token_ids

