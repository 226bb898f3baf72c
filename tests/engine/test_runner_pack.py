"""The step input's one-buffer transfer (step_input.PackedInput): packing then unpacking
inside a jitted function gives back every leaf bit for bit, whatever its dtype; and the
step's persistent buffers (step_program.packed_step): the input slot and the output buffers keep
their device addresses from call to call."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from engine_util import random_prompts, run_staggered, tiny_engine
from jaxinfer.buckets import Bucket
from jaxinfer.config import EngineConfig
from jaxinfer.request import SamplingParams
from jaxinfer.routes import Routes
from jaxinfer.runner import ModelRunner
from jaxinfer.step_input import PackedInput, StepInput, dummy_input, pack_host, unpack


def _random_like(inp: StepInput, rng) -> StepInput:
    def fill(x):
        x = np.asarray(x)
        if x.dtype == np.bool_:
            return rng.integers(0, 2, x.shape).astype(bool)
        if x.dtype == np.uint32:   # high bit set: a plain int32 cast would not survive
            return rng.integers(2**31, 2**32, x.shape, dtype=np.uint64).astype(np.uint32)
        if x.dtype == np.float32:
            return rng.standard_normal(x.shape).astype(np.float32) * 1e3
        return rng.integers(-2**31, 2**31, x.shape).astype(x.dtype)
    return jax.tree_util.tree_map(fill, inp)


@pytest.mark.parametrize("full", [False, True])
def test_pack_unpack_round_trip_in_jit(full):
    rng = np.random.default_rng(int(full))
    inp = _random_like(dummy_input(Bucket(24, 4, 3, False), full, max_num_seqs=8,
                                   vocab_size=64), rng)
    buf, spec = pack_host(inp)
    assert buf.dtype == np.int32 and buf.ndim == 1
    out = jax.jit(unpack, static_argnums=1)(buf, spec, inp.prev_tokens, inp.token_bitmask)
    want, got = jax.tree_util.tree_leaves(inp), jax.tree_util.tree_leaves(out)
    assert len(want) == len(got) > 10
    for w, g in zip(want, got):
        assert np.asarray(g).dtype == np.asarray(w).dtype and np.shape(g) == np.shape(w)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert out.md.decode_only == inp.md.decode_only   # static field kept in the spec


def test_signature_tells_buckets_and_variants_apart():
    sigs = {ModelRunner.prepare(dummy_input(b, full, max_num_seqs=8, vocab_size=64)).signature
            for b in (Bucket(8, 8, 2, True), Bucket(8, 8, 2, False), Bucket(16, 8, 2, False))
            for full in (False, True)}
    assert len(sigs) == 6
    a = ModelRunner.prepare(dummy_input(Bucket(8, 8, 2, True), max_num_seqs=8))
    assert isinstance(a, PackedInput) and ModelRunner.prepare(a) is a


def test_pack_rejects_eight_byte_leaves():
    inp = dummy_input(Bucket(8, 8, 2, True), max_num_seqs=8)
    bad = dataclasses.replace(inp, tokens=np.zeros(8, np.int64))
    with pytest.raises(TypeError, match="int64"):
        pack_host(bad)


def _users(entry: str, name: str) -> list[str]:
    """The lines of an HLO computation that read the instruction `name`."""
    return [line for line in entry.splitlines()
            if re.search(re.escape(name) + r"[,)]", line) and "parameter(" not in line]


def test_step_reads_the_fresh_input_only_through_its_persistent_slot():
    """The compiled step reads the per-call packed buffer in ONE instruction (its copy into
    the donated slot), the slot is aliased to an output, and the slot keeps its device
    buffer across steps: what lets a command buffer skip updating the other kernels."""
    engine = tiny_engine()
    runner = engine.runner
    bucket = engine.buckets.all_buckets()[0]
    p = runner.prepare(dummy_input(bucket, max_num_seqs=runner.engine.max_num_seqs))
    n = p.buf.shape[0]
    text = runner.lower(p).compile().as_text()
    entry = text[text.index("ENTRY"):]
    params = dict((int(size), (name, idx)) for name, size, idx in re.findall(
        r"(\S+) = s32\[(\d+)\]\{0\} parameter\((\d+)\)", entry))
    (buf_name, _), (slot_name, slot_idx) = params[n], params[n + 1]
    users = _users(entry, buf_name)
    # the one reader: the copy into the slot (on the CPU backend a dynamic-update-slice; on
    # the GPU backend a fusion of it, which reads the slot too)
    assert len(users) == 1, users
    assert "dynamic-update-slice" in users[0] or (
        "fusion" in users[0] and _users(users[0], slot_name)), users
    assert re.search(rf"\{{\d+\}}: \({slot_idx}, \{{\}}, may-alias\)", text[:text.index("\n")])
    runner.step(p)
    first = runner._buffers[p.signature][0].unsafe_buffer_pointer()
    runner.step(p)
    runner.step(p)
    assert runner._buffers[p.signature][0].unsafe_buffer_pointer() == first


def _routes(**kw) -> Routes:
    """This backend's routes for the tiny engine, with `kw` replaced."""
    return Routes.choose(EngineConfig(), jax.default_backend()).replace(**kw)


def _addresses(tree):
    return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)]


def test_step_writes_its_results_into_persistent_buffers_and_copies_them_out():
    """Every output of the compiled step is aliased to a donated argument (none lands in
    fresh memory, where XLA may also place step-wide values), the output buffers keep their
    addresses across steps, and what dispatch returns is a copy the next steps do not touch:
    the same tokens as a runner with fresh outputs. (On by default on the GPU only.)"""
    engine = tiny_engine(routes=_routes(persistent_outputs=True))
    runner = engine.runner
    bucket = engine.buckets.all_buckets()[0]
    p = runner.prepare(dummy_input(bucket, max_num_seqs=runner.engine.max_num_seqs))
    lowered = runner.lower(p)
    n_out = len(jax.tree_util.tree_leaves(lowered.out_info))
    text = lowered.compile().as_text()
    header = text.splitlines()[0]
    alias = {int(o): int(i) for o, i in
             re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", header)}
    assert set(alias) == set(range(n_out)), header
    # The buffers are only written: the program reads none of them (the select that keeps
    # them from being pruned is folded away), and the greedy variant's unread rng and step
    # index are pruned as with fresh outputs.
    entry = text[text.index("ENTRY"):]
    params = {int(i): name for name, i in re.findall(r"(\S+) = \S+ parameter\((\d+)\)", entry)}
    for o in range(n_out - 6, n_out):
        assert not _users(entry, params[alias[o]])
    n_kv = len(jax.tree_util.tree_leaves(runner.kv))
    assert len(params) == len(runner._leaves) + n_kv + 1 + 6 + 2   # + buf, prev_tokens

    kv, out1, next1 = runner.dispatch(runner.kv, p, 1)
    held = jax.device_get((out1, next1))
    buffers = _addresses(runner._buffers[p.signature][1])
    assert len(buffers) == 6 and not set(buffers) & set(_addresses((out1, next1)))
    inp = dummy_input(bucket, max_num_seqs=runner.engine.max_num_seqs)
    later = []
    for i in range(2, 5):      # later steps on other tokens overwrite the buffers
        other = runner.prepare(dataclasses.replace(inp, tokens=np.full_like(inp.tokens, 7 * i)))
        assert other.signature == p.signature
        kv, out, next_tokens = runner.dispatch(kv, other, i)
        assert _addresses(runner._buffers[p.signature][1]) == buffers
        later.append(int(jax.device_get(out.tokens)[0]))
    runner.kv = kv
    assert set(later) - {int(held[0].tokens[0])}, later   # the buffers did get other values
    for want, got in zip(jax.tree_util.tree_leaves(held),
                         jax.tree_util.tree_leaves(jax.device_get((out1, next1)))):
        np.testing.assert_array_equal(got, want)
    # Last: on the CPU, reading a buffer directly can keep it from being donated once more.
    np.testing.assert_array_equal(jax.device_get(runner._buffers[p.signature][1][1]),
                                  jax.device_get(next_tokens))


def test_fresh_outputs_give_the_same_steps():
    """Without persistent outputs (the CPU's route): no output buffers, the same answers
    (staggered arrivals, greedy and seeded sampling, logprobs)."""
    prompts = random_prompts(4, seed=3)
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=5, temperature=0.9, seed=1),
              SamplingParams(max_tokens=7, logprobs=2), SamplingParams(max_tokens=4)]
    results = []
    for persistent in (True, False):
        engine = tiny_engine(routes=_routes(persistent_outputs=persistent))
        outs = run_staggered(engine, prompts, params, [0, 0, 2, 3])
        results.append([(o.token_ids, o.logprobs) for o in outs])
        buffers = [b for _, b in engine.runner._buffers.values()]
        assert buffers and all((b is None) != persistent for b in buffers)
    assert results[0] == results[1]


def test_persistent_outputs_default_to_the_gpu():
    runner = tiny_engine().runner
    assert runner.routes.persistent_outputs == (jax.default_backend() == "gpu")
    assert Routes.choose(EngineConfig(), "gpu").persistent_outputs
    assert not Routes.choose(EngineConfig(), "cpu").persistent_outputs
