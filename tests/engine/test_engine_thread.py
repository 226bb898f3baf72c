"""EngineThread (jaxinfer/engine_thread.py): a step's outputs reach their asyncio loops in
one hand-off per loop, in order, and plain sinks still get theirs."""
import asyncio
import threading

from engine_util import random_prompts, tiny_engine

from jaxinfer.engine_thread import EngineThread, LoopSink
from jaxinfer.request import FinishReason, SamplingParams


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



def _streams(deliver_at_wait: bool):
    """8 requests through an EngineThread with plain sinks, the third aborted (notify) once
    it has 2 tokens: (each request's outputs, whether each was handed out inside a step)."""
    thread = EngineThread(tiny_engine, max_waiting=100)
    thread.deliver_at_wait = deliver_at_wait
    thread.start()
    thread.ready.wait()
    assert thread.error is None
    engine, inside = thread.engine, [False]
    step = engine.step

    def marked_step(*args, **kwargs):
        inside[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            inside[0] = False
    engine.step = marked_step
    outputs = {f"r{i}": [] for i in range(8)}
    where, done = [], threading.Semaphore(0)

    def sink(rid):
        def put(item):
            outputs[rid].append(item)
            where.append(inside[0])
            if rid == "r2" and sum(len(o.new_token_ids) for o in outputs[rid]) == 2:
                thread.abort(rid, notify=True)
            if item.finished:
                done.release()
        return put

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        for i, prompt in enumerate(random_prompts(8, seed=5)):
            assert thread.submit(f"r{i}", prompt, params, sink(f"r{i}"))
        for _ in range(8):
            assert done.acquire(timeout=60)
    finally:
        thread.stop()
    return outputs, where


def test_deliver_at_wait_hands_each_step_out_inside_the_next_and_keeps_every_stream():
    """With deliver_at_wait a step's outputs reach their sinks inside the next Engine.step
    (when it waits for the device), except the last before the engine idles; every stream
    is the same as when each step's outputs go out at once, an aborted one included."""
    late, where_late = _streams(True)
    now, where_now = _streams(False)
    assert not any(where_now)
    assert sum(where_late) > len(where_late) / 2 and not where_late[-1], where_late
    for rid in now:
        for outs in (late[rid], now[rid]):    # deltas in order, the last one final
            assert [t for o in outs for t in o.new_token_ids] == outs[-1].outputs[0].token_ids
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        if rid != "r2":
            assert late[rid][-1].outputs[0].token_ids == now[rid][-1].outputs[0].token_ids
    for outs in (late["r2"], now["r2"]):
        assert outs[-1].finish_reason == FinishReason.CANCELLED
