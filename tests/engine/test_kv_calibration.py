"""Static FP8 KV scales (jaxinfer/kv_calibration.py): what the runner calibrates, what the pool
holds, and the engine's outputs with them against per-token scales and unquantized KV."""
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from engine_util import TINY, random_prompts, run_staggered, tiny_engine, tiny_model
from jaxinfer import kv_calibration as kc
from jaxinfer.config import EngineConfig
from jaxinfer.errors import ConfigError
from jaxinfer.kv_cache import KVCache, KVLayers, single_sequence_metadata
from jaxinfer.request import SamplingParams
from jaxinfer.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_scales_from_amax():
    got = kc.scales_from_amax([[448.0, 0.0], [1.0, 2.0]])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[0, 0], kc.HEADROOM)           # amax x headroom -> 448
    np.testing.assert_allclose(got[1], np.array([1.0, 2.0]) * kc.HEADROOM / 448, rtol=1e-6)
    assert 0 < got[0, 1] < 1e-12            # a head that wrote only zeros: tiny, positive


def test_calibration_ids_are_fixed():
    a, b = kc.calibration_ids(1000), kc.calibration_ids(1000)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (kc.CALIBRATION_TOKENS,) and a.min() >= 0 and a.max() < 1000
    assert len(np.unique(a)) > 300


def _unquantized_amax(engine):
    """Each layer's and head's amax of K and V after the calibration tokens run through the
    same model with an unquantized (f32) cache: the runner's own teacher-forcing path."""
    runner = engine.runner
    cfg, eng = runner.cfg, runner.engine
    ids = kc.calibration_ids(cfg.vocab_size)
    pages = -(-len(ids) // eng.page_size)
    saved = runner.kv
    runner.kv = KVCache.allocate(cfg.num_layers, cfg.num_kv_heads, pages + 1, eng.page_size,
                                 cfg.head_dim, jnp.float32)
    try:
        runner.all_logits(ids, single_sequence_metadata(
            np.arange(len(ids)), np.arange(1, pages + 1), eng.page_size, pages))
        return [np.asarray(x) for x in kc.head_amax(runner.kv)]
    finally:
        runner.kv = saved


def test_runner_calibrates_the_pool():
    engine = tiny_engine(kv_dtype="fp8")             # static scales: the default
    runner = engine.runner
    cfg = runner.cfg
    ks, vs = runner.static_kv_scales
    assert ks.shape == vs.shape == (cfg.num_layers, cfg.num_kv_heads)
    assert runner.kv.static_scales
    np.testing.assert_array_equal(np.asarray(runner.kv.k_scale), ks)
    np.testing.assert_array_equal(np.asarray(runner.kv.v_scale), vs)
    k_amax, v_amax = _unquantized_amax(engine)
    assert (k_amax > 0).all() and (v_amax > 0).all()
    np.testing.assert_allclose(ks, k_amax * kc.HEADROOM / 448, rtol=1e-5)
    np.testing.assert_allclose(vs, v_amax * kc.HEADROOM / 448, rtol=1e-5)
    token = tiny_engine(kv_dtype="fp8", kv_scales="token").runner
    assert token.static_kv_scales is None and not token.kv.static_scales
    assert token.kv.k_scale.shape == token.kv.k.shape[:-1]
    assert tiny_engine().runner.static_kv_scales is None         # unquantized KV


def _tiny_runner(**engine_kw):
    graphdef, params = tiny_model()
    return ModelRunner(TINY, EngineConfig(max_model_len=128, max_num_seqs=8, page_size=4,
                                          max_num_batched_tokens=64, **engine_kw),
                       graphdef, params)


def test_the_runner_is_built_while_its_calibration_runs_and_its_pool_waits_for_it(monkeypatch):
    """The calibration's forward (a compile on a cold start) overlaps what follows the
    runner's construction (the warm-up's compiles); the first use of the pool waits for the
    calibrated scales and holds them, not the placeholders."""
    release, calibrate = threading.Event(), kc.engine_scales

    def held(*args):
        assert release.wait(120), "the runner waited for its calibration"
        return calibrate(*args)

    monkeypatch.setattr(kc, "engine_scales", held)
    runner = _tiny_runner(kv_dtype="fp8")
    release.set()
    ks, vs = runner.static_kv_scales
    assert not np.all(ks == 1) and not np.all(vs == 1)
    for i, layer in enumerate(runner.kv.layers if isinstance(runner.kv, KVLayers)
                              else [runner.kv]):
        rows = slice(i, i + 1) if isinstance(runner.kv, KVLayers) else slice(None)
        np.testing.assert_array_equal(np.asarray(layer.k_scale), ks[rows])
        np.testing.assert_array_equal(np.asarray(layer.v_scale), vs[rows])
    monkeypatch.setattr(kc, "engine_scales", calibrate)
    np.testing.assert_array_equal(_tiny_runner(kv_dtype="fp8").static_kv_scales[0], ks)


def test_a_failed_calibration_fails_every_use_of_the_pool(monkeypatch):
    def failing(*args):
        raise RuntimeError("calibration forward failed")

    monkeypatch.setattr(kc, "engine_scales", failing)
    runner = _tiny_runner(kv_dtype="fp8")
    for _ in range(2):      # never the placeholder scales
        with pytest.raises(RuntimeError, match="calibration forward failed"):
            runner.kv
    with pytest.raises(RuntimeError, match="calibration forward failed"):
        runner.static_kv_scales


def test_with_scales_replaces_only_the_scales_in_either_layer_form():
    ones = (np.ones((3, 2), np.float32),) * 2
    scales = (np.arange(6, dtype=np.float32).reshape(3, 2) + 1, np.full((3, 2), 0.5, np.float32))
    layers = KVLayers.allocate(3, 2, 5, 4, 16, jnp.float8_e4m3fn, scales=ones)
    got = kc.with_scales(layers, scales)
    for i, (old, new) in enumerate(zip(layers.layers, got.layers)):
        assert new.k is old.k and new.v is old.v
        np.testing.assert_array_equal(np.asarray(new.k_scale), scales[0][i:i + 1])
        np.testing.assert_array_equal(np.asarray(new.v_scale), scales[1][i:i + 1])
    stacked = kc.with_scales(KVCache.allocate(3, 2, 5, 4, 16, jnp.float8_e4m3fn, scales=ones),
                             scales)
    np.testing.assert_array_equal(np.asarray(stacked.k_scale), scales[0])
    np.testing.assert_array_equal(np.asarray(stacked.v_scale), scales[1])


def test_static_scales_follow_the_layer_form():
    """Unrolled (per-layer KV arrays): layer i's cache holds row i of the scales."""
    scales = (np.arange(6, dtype=np.float32).reshape(3, 2) + 1, np.full((3, 2), 0.5, np.float32))
    pool = KVLayers.allocate(3, 2, 5, 4, 16, jnp.float8_e4m3fn, scales=scales)
    assert pool.static_scales
    for i, layer in enumerate(pool.layers):
        np.testing.assert_array_equal(np.asarray(layer.k_scale), scales[0][i:i + 1])
    with pytest.raises(ValueError, match=r"\[L, K\]"):
        KVCache.allocate(3, 2, 5, 4, 16, jnp.float8_e4m3fn, scales=(scales[0][:2], scales[1]))
    with pytest.raises(ValueError, match="FP8"):
        KVCache.allocate(3, 2, 5, 4, 16, jnp.bfloat16, scales=scales)
    with pytest.raises(ConfigError, match="kv_scales"):
        tiny_engine(kv_dtype="fp8", kv_scales="page")


def test_static_fp8_kv_outputs_track_the_others():
    """Greedy outputs on the tiny model: static-scale FP8 KV against per-token FP8 KV and
    unquantized KV. FP8 KV moves logits a little, so a long greedy run may fork; most
    tokens must still agree (per-token FP8 against unquantized is the yardstick)."""
    prompts = random_prompts(6, seed=4)
    runs = {name: [o.token_ids for o in run_staggered(tiny_engine(**kw), prompts,
                                                      [GREEDY] * 6, [0] * 6)]
            for name, kw in (("f32", {}), ("static", dict(kv_dtype="fp8")),
                             ("token", dict(kv_dtype="fp8", kv_scales="token")))}

    def agreement(a, b):
        same = sum(x == y for ra, rb in zip(runs[a], runs[b]) for x, y in zip(ra, rb))
        return same / sum(len(r) for r in runs[a])

    print({pair: round(agreement(*pair), 3) for pair in (("f32", "static"), ("f32", "token"))})
    assert agreement("f32", "static") >= min(0.9, agreement("f32", "token") - 0.05)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from bench.common import engine_argv
    from jaxinfer.cli import add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--kv-dtype", "fp8", "--kv-scales", "token"])
    assert engine_config_from_args(args).kv_scales == "token"
    assert p.parse_args(engine_argv(args)).kv_scales == "token"   # child processes keep it
    assert engine_config_from_args(p.parse_args([])).kv_scales == "static"


def test_every_engine_flag_reaches_a_child_process():
    """engine_argv (what the benches start their servers and children with) carries every
    engine flag that differs from its default, so the child's EngineConfig is the parent's."""
    import argparse

    from bench.common import engine_argv
    from jaxinfer.cli import add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--model", "llama-3-8b", "--weights", "fp8", "--kv-dtype", "fp8",
            "--kv-scales", "token", "--max-num-seqs", "128", "--max-num-batched-tokens",
            "2048", "--itl-target-ms", "10", "--no-prefix-caching", "--tensor-parallel", "2",
            "--unroll-layers", "--no-async-scheduling", "--compile-cache-dir", "/tmp/x",
            "--warmup", "off", "--lora", "a=/tmp/a", "--lora", "b=/tmp/b", "--max-loras", "2",
            "--num-speculative-tokens", "3", "--speculative-method", "self"]
    args = p.parse_args(argv)
    child = p.parse_args(engine_argv(args))
    assert engine_config_from_args(child) == engine_config_from_args(args)
    assert child.model == "llama-3-8b" and child.lora == [("a", "/tmp/a"), ("b", "/tmp/b")]
    assert engine_config_from_args(child).itl_target_ms == 10.0
    assert engine_argv(p.parse_args([])) == []       # defaults say nothing
