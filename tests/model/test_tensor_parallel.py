"""Tensor parallelism on 8 virtual CPU devices: greedy outputs under continuous batching are
identical at tp = 1, 2, 4 (tiny model: reference and Pallas attention, FP8 weights, LoRA
adapters in a mixed batch) and
tp = 1, 2 (SmolLM2, whose 9/3 heads replicate attention at tp=2); weights (the int8 LM head's
and its dense copy's too) and the KV cache really are sharded; the compiled step gathers no
weight.

The checks run in ONE child process (this file run as a script): the pytest process has
already initialised jax with one device, and the device count is fixed at jax start-up.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent      # the shared helpers (dense_reference, engine_util)
TINY_PROMPTS, TINY_ARRIVALS = 4, [0, 0, 2, 5]


# --- the child: computes everything, prints one JSON line -------------------------------

def _engine_tokens(engine, prompts, max_tokens, arrivals, loras=None):
    from engine_util import run_staggered
    from jaxinfer.request import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             lora=lora) for lora in (loras or [None] * len(prompts))]
    outs = run_staggered(engine, prompts, params, arrivals)
    return [o.token_ids for o in outs]


def _tiny_lora(tp: int, prompts, root) -> list:
    """Greedy tokens of a mixed batch over two adapters (and the base model) at `tp`."""
    from checkpoints.synthetic_lora import write_random_adapter
    from engine_util import TINY

    engine = _tiny(tp, max_loras=2, max_lora_rank=8)
    for i, name in enumerate(("a", "b")):
        engine.load_lora(name, write_random_adapter(f"{root}/{name}", TINY, rank=4 + 4 * i,
                                                    seed=i, std=0.3))
    return _engine_tokens(engine, prompts, 8, TINY_ARRIVALS, ["a", None, "b", "a"])


def _specs(engine) -> dict:
    p = engine.runner.params
    leaf = lambda x: list(x[...].sharding.spec)  # noqa: E731
    return {"wqkv": leaf(p["layers"]["attn"]["wqkv"]["kernel"]),
            "wo": leaf(p["layers"]["attn"]["wo"]["kernel"]),
            "w_gateup": leaf(p["layers"]["mlp"]["w_gateup"]["kernel"]),
            "w_down": leaf(p["layers"]["mlp"]["w_down"]["kernel"]),
            "embed": leaf(p["embed"]), "kv": list(engine.runner.kv.k.sharding.spec),
            "kv_shard_shape": list(engine.runner.kv.k.addressable_shards[0].data.shape)}


def _gathered_elements(engine) -> int:
    """The largest all-gather in the compiled decode step, in elements."""
    import math
    import re

    import jax
    from jaxinfer.step_input import dummy_input

    bucket = next(b for b in engine.buckets.all_buckets() if b.decode_only)
    hlo = engine.runner.lower(jax.device_put(dummy_input(bucket))).compile().as_text()
    sizes = [math.prod(int(d) for d in dims.split(",") if d)
             for dims in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", hlo)]
    return max(sizes, default=0)


def _tiny(tp: int, **kw):
    import jax.numpy as jnp

    from dense_reference import random_flat
    from engine_util import TINY
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine
    from checkpoints.model_state import build_model
    from jaxinfer.sharding import make_layout

    fp8 = kw.get("weights") == "fp8"
    graphdef, params = build_model(TINY, random_flat(TINY, seed=11, std=0.08), jnp.float32,
                                   fp8=fp8, layout=make_layout(TINY, tp),
                                   unroll_layers=bool(kw.get("unroll_layers")))
    # Few buckets (decode B=1,2 and one mixed T=16): compiles dominate this test's time.
    cfg = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                       page_size=4, tensor_parallel=tp, **kw)
    return Engine(TINY, cfg, graphdef, params)


def _synthetic_logits(tp: int, spec_of=("lm_head", "kernel"), **kw):
    """Teacher-forced logits of the tiny standard shape loaded by name (synthetic weights
    generated sharded; with weights="fp8" generated quantized too) through the runner, and
    the sharding spec of the param at path `spec_of`."""

    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine
    from jaxinfer.kv_cache import single_sequence_metadata as single_sequence_md

    engine = Engine.from_model("tiny", EngineConfig(max_model_len=32, max_num_seqs=1,
                                                    page_size=4, tensor_parallel=tp, **kw))
    tokens = np.arange(5, 15, dtype=np.int32)
    md = single_sequence_md(np.arange(10), [1, 2, 3], 4, engine.config.pages_per_seq)
    leaf = engine.runner.params
    for key in spec_of:
        leaf = leaf[key]
    sharding = leaf[...].sharding
    return engine.runner.all_logits(tokens, md).tolist(), list(getattr(sharding, "spec", ()))


def _layout_mismatch_error() -> str:
    """Unsharded params handed to a tp=2 engine must be refused, not run slowly."""
    import jax.numpy as jnp

    from dense_reference import random_flat
    from engine_util import TINY
    from jaxinfer.config import EngineConfig
    from jaxinfer.errors import ConfigError
    from checkpoints.model_state import build_model
    from jaxinfer.runner import ModelRunner

    graphdef, params = build_model(TINY, random_flat(TINY, seed=1), jnp.float32)
    try:
        ModelRunner(TINY, EngineConfig(max_model_len=32, max_num_seqs=1, tensor_parallel=2),
                    graphdef, params)
    except ConfigError as e:
        return str(e)
    return ""


def child_main() -> dict:
    from engine_util import random_prompts
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine

    prompts = random_prompts(TINY_PROMPTS, hi=24, seed=1)
    res = {"tiny": {}, "smollm2": {}, "specs": {}}
    for tp in (1, 2, 4):
        engine = _tiny(tp)
        res["tiny"][str(tp)] = _engine_tokens(engine, prompts, 8, TINY_ARRIVALS)
        if tp > 1:
            res["specs"][f"tiny{tp}"] = _specs(engine)
            res[f"gathered{tp}"] = _gathered_elements(engine)
    res["tiny_pallas2"] = _engine_tokens(_tiny(2, attention_impl="pallas"), prompts, 8,
                                         TINY_ARRIVALS)
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        res["tiny_lora"] = {str(tp): _tiny_lora(tp, prompts, root) for tp in (1, 2, 4)}
    engine = _tiny(2, unroll_layers=True)    # the GPU's layer loop: a KV pool per layer
    res["tiny_unrolled2"] = _engine_tokens(engine, prompts, 8, TINY_ARRIVALS)
    kv = engine.runner.kv
    res["specs"]["tiny_unrolled2"] = {
        "form": type(kv).__name__, "layers": len(kv.layers),
        "kv": [list(c.k.sharding.spec) for c in kv.layers],
        "kv_shard_shape": list(kv.layers[-1].v.addressable_shards[0].data.shape)}
    for tp in (1, 2):
        res[f"tiny_fp8_{tp}"] = _engine_tokens(_tiny(tp, weights="fp8", kv_dtype="fp8"),
                                               prompts[:2], 6, [0, 1])
    res["synthetic"] = {str(tp): _synthetic_logits(tp) for tp in (1, 2)}
    res["synthetic_fp8"] = {str(tp): _synthetic_logits(tp, weights="fp8") for tp in (1, 2)}
    res["synthetic_int8_head"] = {str(tp): _synthetic_logits(tp, lm_head="int8")
                                  for tp in (1, 2)}
    from jaxinfer import config
    limit, config.INT8_HEAD_MAX_ROWS = config.INT8_HEAD_MAX_ROWS, 4   # 10 rows: the copy
    res["synthetic_auto_head"] = {str(tp): _synthetic_logits(tp, ("lm_head_dense",),
                                                             lm_head="auto")
                                  for tp in (1, 2)}
    config.INT8_HEAD_MAX_ROWS = limit
    res["mismatch_error"] = _layout_mismatch_error()
    smol = ["The capital of France is", "def fib(n):"]
    for tp in (1, 2):
        engine = Engine.from_model("smollm2", EngineConfig(
            max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16, tensor_parallel=tp))
        res["smollm2"][str(tp)] = _engine_tokens(engine, smol, 5, [0, 1])
        if tp > 1:
            res["specs"]["smollm2"] = _specs(engine)
    return res


# --- the tests: one child run, many assertions -------------------------------------------

@pytest.fixture(scope="module")
def results():
    # The worker's own XLA flags (tests/conftest.py's optimization level) stay, beside the
    # eight host devices the child needs.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(TESTS),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600, cwd=TESTS.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tiny_greedy_identical_at_tp_1_2_4(results):
    tiny = results["tiny"]
    assert len({tuple(t) for t in tiny["1"]}) == TINY_PROMPTS, "prompts should differ"
    assert tiny["2"] == tiny["1"]
    assert tiny["4"] == tiny["1"]


def test_tiny_lora_adapters_identical_at_tp_1_2_4(results):
    lora = results["tiny_lora"]
    assert lora["2"] == lora["1"] and lora["4"] == lora["1"]
    assert lora["1"][0] != results["tiny"]["1"][0]      # the adapter changes the answer
    assert lora["1"][1] == results["tiny"]["1"][1]      # the base row is the base model's


def test_tiny_pallas_attention_per_shard_matches(results):
    assert results["tiny_pallas2"] == results["tiny"]["1"]


def test_tiny_unrolled_layers_per_layer_kv_shard(results):
    """Unrolled (the GPU default), the pool is one KVCache per layer, each split by kv head
    like the stacked one, and the tokens are tp=1's."""
    from engine_util import TINY

    assert results["tiny_unrolled2"] == results["tiny"]["1"]
    spec = results["specs"]["tiny_unrolled2"]
    assert spec["form"] == "KVLayers" and spec["layers"] == TINY.num_layers
    assert spec["kv"] == [[None, "tp"]] * TINY.num_layers
    assert spec["kv_shard_shape"][:2] == [1, 1]      # one layer, K=2 over 2 devices


def test_tiny_fp8_weights_and_kv_shard(results):
    assert results["tiny_fp8_2"] == results["tiny_fp8_1"]


def test_synthetic_weights_generated_sharded(results):
    (ref, ref_spec), (got, spec) = results["synthetic"]["1"], results["synthetic"]["2"]
    assert spec == [None, "tp"] and ref_spec == []
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


def test_synthetic_fp8_weights_generated_sharded(results):
    """FP8 synthetic weights are generated quantized per shard: the same model at tp 1, 2."""
    (ref, _), (got, spec) = results["synthetic_fp8"]["1"], results["synthetic_fp8"]["2"]
    assert spec == [None, "tp"]
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


def test_int8_head_split_by_vocab(results):
    """The int8 LM head's codes [V, E] are split along V (the float head's [E, V] along its
    last axis): the same logits at tp 1 and 2, and not the float head's."""
    (ref, ref_spec), (got, spec) = (results["synthetic_int8_head"]["1"],
                                    results["synthetic_int8_head"]["2"])
    assert spec == ["tp", None] and ref_spec == []
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
    float_ref = np.asarray(results["synthetic"]["1"][0])
    assert not np.allclose(np.asarray(ref), float_ref, rtol=1e-5, atol=1e-5)


def test_auto_head_dense_copy_split_by_vocab(results):
    """lm_head="auto" above its row limit reads the dense copy [V, E], split along V like
    the embedding: the same logits at tp 1 and 2, and the int8 head's to float rounding."""
    (ref, ref_spec), (got, spec) = (results["synthetic_auto_head"]["1"],
                                    results["synthetic_auto_head"]["2"])
    assert spec == ["tp", None] and ref_spec == []
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(ref, results["synthetic_int8_head"]["1"][0], rtol=1e-4,
                               atol=1e-4)


def test_smollm2_greedy_identical_at_tp_1_2(results):
    assert results["smollm2"]["2"] == results["smollm2"]["1"]
    assert all(len(t) == 5 for t in results["smollm2"]["1"])


def test_params_and_kv_cache_are_sharded(results):
    s2, s4, smol = (results["specs"][k] for k in ("tiny2", "tiny4", "smollm2"))
    col, row, vocab, rep = [None, None, "tp"], [None, "tp", None], ["tp", None], []
    assert (s2["wqkv"], s2["wo"], s2["w_gateup"], s2["w_down"], s2["embed"]) == (
        col, row, col, row, vocab)
    assert s2["kv"] == [None, "tp"] and s2["kv_shard_shape"][1] == 1  # K=2 over 2 devices
    # tp=4: 2 kv heads do not divide -> attention and cache replicated, the MLP still split.
    assert (s4["wqkv"], s4["kv"], s4["w_gateup"]) == (rep, rep, col)
    assert s4["kv_shard_shape"][1] == 2
    # SmolLM2 at tp=2: 9 q / 3 kv heads -> attention replicated; ffn 1536 and vocab split.
    assert (smol["wqkv"], smol["kv"]) == (rep, rep)
    assert (smol["w_gateup"], smol["w_down"], smol["embed"]) == (col, row, vocab)


def test_decode_step_gathers_no_weight(results):
    """Only the [B, V] logits (sampling) may be all-gathered; a weight gather would mean
    GSPMD lost the column/row split. Tiny: B=1 decode bucket, V=512, E*V weights."""
    assert 0 < results["gathered2"] <= 2 * 512
    assert results["gathered4"] <= 2 * 512


def test_params_of_another_layout_are_refused(results):
    assert "tensor-parallel layout" in results["mismatch_error"]


def test_more_devices_than_present_is_a_clear_error():
    from engine_util import TINY
    from jaxinfer.errors import ConfigError
    from jaxinfer.sharding import make_layout

    import jax
    with pytest.raises(ConfigError, match="tensor_parallel=.* needs .* devices"):
        make_layout(TINY, len(jax.devices()) + 1)


if __name__ == "__main__":
    from gguf_share import share_the_embedded_gguf_parse
    share_the_embedded_gguf_parse()   # the two SmolLM2 engines parse it once, as in pytest
    print(json.dumps(child_main()))
