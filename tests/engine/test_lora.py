"""Multi-LoRA serving: adapters in PEFT's format, applied per row in mixed batches.

The tiny model's oracle is the same model with each adapter merged into its weights
(W + A B * scaling); SmolLM2's is HF transformers + peft loading the same GGUF and adapters."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.fp8 import LINEAR_NAMES, dequantize_linear, quantize_linear
from checkpoints.model_state import build_model
from dense_reference import random_flat
from engine_util import TINY, random_prompts, tiny_engine
from jaxinfer.cli import main
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.lora import read_peft
from jaxinfer.request import SamplingParams
from jaxinfer.routes import Routes
from lora_util import write_adapter

GREEDY = dict(temperature=0.0, max_tokens=10)
FLAT_NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
              "down": "w_down"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three tiny adapters: all modules at rank 8; q/v only at rank 4 with rsLoRA; MLP only
    on two layers at rank 16."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_adapter(root / "all", TINY, rank=8, seed=1, std=0.25),
        "qv": write_adapter(root / "qv", TINY, rank=4, alpha=8, seed=2, std=0.35,
                            modules=("q", "v"), config_extra={"use_rslora": True}),
        "mlp": write_adapter(root / "mlp", TINY, rank=16, alpha=8, seed=3, std=0.25,
                             modules=("gate", "up", "down"), layers=[0, 1]),
    }


def merged_engine(path, base=None, **kw) -> Engine:
    """The tiny model with the adapter at `path` merged into its weights, no LoRA; `base`:
    weights that replace the model's own first."""
    flat = {**random_flat(TINY, seed=11, std=0.08), **(base or {})}
    if path is not None:
        adapter = read_peft("merged", path, TINY, 64)
        for m, (a, b) in adapter.weights.items():
            flat[FLAT_NAMES[m]] = flat[FLAT_NAMES[m]] + a @ b
    graphdef, params = build_model(TINY, flat, jnp.float32)
    cfg = EngineConfig(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                       page_size=4, **kw)
    return Engine(TINY, cfg, graphdef, params)


def generate(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = engine.run_until_done(use_tqdm=False)
    return [done[i].token_ids for i in ids]


def lora_engine(adapters, **kw) -> Engine:
    engine = tiny_engine(**{"max_loras": 2, "max_lora_rank": 16, **kw})
    for name, path in adapters.items():
        engine.load_lora(name, path)
    return engine


def check_nothing_held(engine):
    sched = engine.scheduler
    sched.allocator.check()
    assert sched.allocator.num_used == 0 and not sched.running and not sched.waiting
    assert sched.lora_slots.num_held == 0


def test_a_mixed_batch_matches_each_adapter_merged_into_the_weights(adapters):
    prompts = random_prompts(8, seed=5)
    names = [None, "all", "qv", "mlp", "all", None, "mlp", "qv"]
    # three adapters over two slots: adapters wait for a slot, then swap in
    engine = lora_engine(adapters)
    got = generate(engine, prompts, [SamplingParams(**GREEDY, lora=n) for n in names])
    expected = {}
    for name in set(names):
        want = generate(merged_engine(None if name is None else adapters[name]),
                        [p for p, n in zip(prompts, names) if n == name],
                        [SamplingParams(**GREEDY)] * names.count(name))
        expected[name] = iter(want)
    assert got == [next(expected[n]) for n in names]
    base = [g for g, n in zip(got, names) if n is None]
    assert all(g not in base for g, n in zip(got, names) if n is not None)  # adapters matter
    check_nothing_held(engine)


GPU_ROUTES = Routes(attention="pallas", interpret=True, fused_glue=True, front_max_rows=8,
                    lora_kernel=True)


def traced_fronts_and_updates(monkeypatch):
    """Lists that fill as steps are traced: each fused decode front's row count, and each
    LoRA kernel's (rows, y's rank: 3 where it adds into the front's partial products)."""
    from jaxinfer import lora_layers, ops

    fronts, updates = [], []
    front, kernel = ops.dq.paged_attention_qkv, lora_layers.lora_kernels.lora_update
    monkeypatch.setattr(ops.dq, "paged_attention_qkv",
                        lambda *a, **kw: fronts.append(a[0].shape[1]) or front(*a, **kw))
    monkeypatch.setattr(lora_layers.lora_kernels, "lora_update",
                        lambda *a, **kw: updates.append((a[1].shape[0], a[0].ndim))
                        or kernel(*a, **kw))
    return fronts, updates


def test_unrolled_layers_on_the_gpu_s_kernel_routes_give_the_merged_tokens(adapters,
                                                                           monkeypatch):
    """The GPU's form: a dict of adapter weights per layer, Pallas attention (interpreted)
    with the fused RoPE + K/V write, LoRA's update in its kernels (pallas_kernels/lora.py);
    decode steps of up to 8 rows take the fused decode front with the RMSNorm folded, QKV's
    update added into its partial products."""
    fronts, updates = traced_fronts_and_updates(monkeypatch)
    prompts = random_prompts(4, seed=8)
    names = ["all", None, "qv", "all"]
    graphdef, params = build_model(TINY, random_flat(TINY, seed=11, std=0.08), jnp.float32,
                                   unroll_layers=True)
    engine = Engine(TINY, EngineConfig(max_model_len=128, max_num_seqs=8, page_size=4,
                                       max_num_batched_tokens=64, max_loras=2,
                                       max_lora_rank=16), graphdef, params, routes=GPU_ROUTES)
    assert isinstance(engine.runner.lora, tuple)     # a dict per layer
    for name in ("all", "qv"):
        engine.load_lora(name, adapters[name])
    got = generate(engine, prompts, [SamplingParams(**GREEDY, lora=n) for n in names])
    for g, p, n in zip(got, prompts, names):
        merged = merged_engine(None if n is None else adapters[n])
        assert g == generate(merged, [p], [SamplingParams(**GREEDY)])[0]
    assert {t for t, _ in updates} >= {1, 4}     # decode steps of 1 and 4 rows among them
    assert set(fronts) >= {1, 4} and {(1, 3), (4, 3)} <= set(updates)


def test_fp8_base_weights_take_adapters_too(adapters, monkeypatch):
    """FP8 linears (weight-only on the CPU: x @ the dequantized weights) plus each adapter
    give the float model whose linears are the dequantized FP8 weights plus the adapter. On
    the GPU's routes: the fused decode front multiplies its sum by the channel scales, so
    QKV's update joins its partial products divided by them (XLA's form)."""
    fronts, _ = traced_fronts_and_updates(monkeypatch)
    flat = random_flat(TINY, seed=11, std=0.08)
    graphdef, params = build_model(TINY, flat, jnp.float32, fp8=True, unroll_layers=True)
    engine = Engine(TINY, EngineConfig(max_model_len=128, max_num_seqs=8, page_size=4,
                                       max_num_batched_tokens=64, max_loras=2,
                                       max_lora_rank=16), graphdef, params, routes=GPU_ROUTES)
    for name in ("all", "mlp"):
        engine.load_lora(name, adapters[name])
    prompts, names = random_prompts(3, seed=12), ["all", None, "mlp"]
    got = generate(engine, prompts, [SamplingParams(**GREEDY, lora=n) for n in names])
    dequantized = {k: np.asarray(dequantize_linear(*quantize_linear(flat[k])))
                   for k in LINEAR_NAMES}
    for g, p, n in zip(got, prompts, names):
        merged = merged_engine(None if n is None else adapters[n], base=dequantized)
        assert g == generate(merged, [p], [SamplingParams(**GREEDY)])[0], n
    assert fronts


def test_a_request_gives_the_same_tokens_alone_and_among_other_adapters(adapters):
    prompts = random_prompts(6, seed=9)
    names = ["qv", "all", None, "mlp", "qv", "all"]
    params = [SamplingParams(**GREEDY, lora=n) for n in names]
    engine = lora_engine(adapters, max_loras=3)
    together = generate(engine, prompts, params)
    alone = [generate(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert together == alone
    check_nothing_held(engine)


def test_swapping_adapters_in_and_out_compiles_nothing_after_warmup(adapters):
    engine = lora_engine(adapters, max_loras=1, max_num_seqs=4)
    engine.warmup(progress=False)
    compiles = engine.compiles()
    prompts = random_prompts(6, seed=3)
    names = ["all", "qv", "mlp", None, "qv", "all"]
    for p, n in zip(prompts, names):      # each adapter in its turn takes the one slot
        generate(engine, [p], [SamplingParams(**GREEDY, lora=n)])
    batch = generate(engine, prompts, [SamplingParams(**GREEDY, lora=n) for n in names])
    assert engine.compiles() == compiles
    engine.warmup(progress=False)     # again, with an adapter in the slot: it stays there
    assert generate(engine, prompts, [SamplingParams(**GREEDY, lora=n) for n in names]) == batch
    check_nothing_held(engine)


def test_the_prefix_cache_never_shares_pages_between_adapters(adapters):
    engine = lora_engine(adapters)
    prompt = random_prompts(1, lo=30, hi=31, seed=4)
    base = generate(engine, prompt, [SamplingParams(**GREEDY)])
    seen = []

    def hits(name):
        rid = engine.add_request(prompt[0], SamplingParams(**GREEDY, lora=name))
        engine.step()
        seen.append(engine.scheduler.get(rid).num_prefix_hit_tokens)
        return engine.run_until_done(use_tqdm=False)[rid].token_ids

    with_all = hits("all")
    assert with_all != base and seen[-1] == 0     # the base model's pages are not reused
    assert hits("all") == with_all and seen[-1] > 0    # the adapter's own are
    assert hits("qv") != with_all and seen[-1] == 0
    # unloaded and loaded again under its name, another adapter starts from nothing
    engine.unload_lora("all")
    engine.load_lora("all", adapters["mlp"])
    assert hits("all") == hits("mlp")
    assert seen[-2] == 0
    check_nothing_held(engine)


def test_n_completions_and_preemption_keep_their_adapter(adapters):
    prompts = random_prompts(4, lo=20, hi=30, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=12, lora=n, n=k)
              for n, k in (("all", 2), ("qv", 1), ("all", 1), (None, 2))]
    # a pool this small preempts requests mid-answer
    engine = lora_engine(adapters, num_pages=24)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = engine.run_until_done(use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    for rid, p, sp in zip(ids, prompts, params):
        want = generate(merged_engine(None if sp.lora is None else adapters[sp.lora]), [p],
                        [SamplingParams(temperature=0.0, max_tokens=12)])[0]
        assert [c.token_ids for c in done[rid].outputs] == [want] * sp.n
    check_nothing_held(engine)


def test_adapters_out_of_host_memory_are_read_again_and_a_vanished_one_fails_alone(
        adapters, tmp_path):
    import shutil
    gone = shutil.copytree(adapters["qv"], tmp_path / "qv")
    engine = lora_engine({"all": adapters["all"], "qv": gone}, max_loras=1, max_cpu_loras=1)
    prompts = random_prompts(3, seed=21)
    first = [generate(engine, [p], [SamplingParams(**GREEDY, lora=n)])[0]
             for p, n in zip(prompts, ["all", "qv", "all"])]     # each swap reads again
    merged = {n: merged_engine(adapters[n]) for n in ("all", "qv")}
    assert first == [generate(merged[n], [p], [SamplingParams(**GREEDY)])[0]
                     for p, n in zip(prompts, ["all", "qv", "all"])]
    shutil.rmtree(gone)       # "qv" is out of host memory and now off the disk too
    ids = [engine.add_request(p, SamplingParams(**GREEDY, lora=n))
           for p, n in zip(prompts, ["all", "qv", None])]
    done = engine.run_until_done(use_tqdm=False)
    assert done[ids[1]].finish_reason == "error" and "adapter_config.json" in done[ids[1]].error
    assert done[ids[0]].token_ids == first[0]
    assert done[ids[2]].finish_reason == "length"
    check_nothing_held(engine)


def test_unknown_and_unloaded_adapters_are_refused_naming_the_field(adapters):
    engine = lora_engine(adapters)
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'nope'") as e:
        engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(lora="nope"))
    assert e.value.field == "lora"
    engine.unload_lora("qv")
    with pytest.raises(InvalidRequestError, match="'qv'"):
        engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(lora="qv"))
    with pytest.raises(InvalidRequestError, match="already loaded"):
        engine.load_lora("all", adapters["mlp"])
    assert engine.lora_names() == ["all", "mlp"]
    plain = tiny_engine()
    with pytest.raises(InvalidRequestError, match="max_loras is 0") as e:
        plain.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(lora="all"))
    assert e.value.field == "lora"
    with pytest.raises(ConfigError, match="max_loras"):
        plain.load_lora("all", adapters["all"])
    with pytest.raises(InvalidRequestError, match="lora"):
        SamplingParams(lora="")


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json not found"),
    (lambda d: (d / "adapter_config.json").write_text("{"), "does not parse"),
    (lambda d: _config(d, r=32), "rank 32 exceeds max_lora_rank 16"),
    (lambda d: _config(d, use_dora=True), "DoRA is not supported"),
    (lambda d: _config(d, peft_type="PREFIX_TUNING"), "only LORA"),
    (lambda d: _config(d, r=4), r"has shape \(\d+, \d+\); the base model .* with r=4 needs"),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b"junk"), "does not load"),
])
def test_a_bad_adapter_is_refused_with_what_is_wrong(tmp_path, change, message):
    path = write_adapter(tmp_path / "bad", TINY, rank=8, seed=1)
    change(path)
    engine = tiny_engine(max_loras=1)
    with pytest.raises(InvalidRequestError, match=message) as e:
        engine.load_lora("bad", path)
    assert "'bad'" in str(e.value) and engine.lora_names() == []


def test_adapters_for_another_model_are_refused(tmp_path):
    other = TINY.__class__(**{**TINY.__dict__, "num_layers": TINY.num_layers + 2})
    path = write_adapter(tmp_path / "deep", other, rank=4)
    with pytest.raises(InvalidRequestError, match=f"layer {TINY.num_layers}, but the model"):
        tiny_engine(max_loras=1).load_lora("deep", path)


def _config(path, **changes):
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig(max_loras=1, max_lora_rank=65)
    with pytest.raises(ConfigError, match="max_loras"):
        EngineConfig(max_loras=-1)


def test_the_command_line_serves_adapters_in_an_offline_batch(adapters, tmp_path, capsys):
    lines = [{"id": i, "prompt_token_ids": p["prompt_token_ids"], "max_tokens": 6,
              "temperature": 0.0, **({"lora": n} if n else {})}
             for i, (p, n) in enumerate(zip(random_prompts(4, seed=2),
                                            [None, "all", "qv", "all"]))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    loras = [f"{n}={adapters[n]}" for n in ("all", "qv")]
    assert main(["generate", "--model", "tiny", "--input", str(inp), "--output", str(out),
                 *[a for lo in loras for a in ("--lora", lo)]]) == 0
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    engine = Engine.from_model("tiny", EngineConfig(max_loras=2),
                               [("all", adapters["all"]), ("qv", adapters["qv"])])
    params = [SamplingParams(max_tokens=6, temperature=0.0, lora=line.get("lora"))
              for line in lines]
    assert [got[i] for i in range(4)] == generate(
        engine, [{"prompt_token_ids": line["prompt_token_ids"]} for line in lines], params)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "tiny", "--lora", "nameonly"])
    assert e.value.code == 2
    assert "expected NAME=PATH" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--input", str(inp), "--output",
                 str(tmp_path / "o2.jsonl"), "--lora", f"all={tmp_path}"]) == 2
    assert "adapter_config.json not found" in capsys.readouterr().err
