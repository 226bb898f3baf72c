"""Greedy outputs pinned to a committed fixture: a refactor that changes any token fails here.

The fixture (tests/fixtures/greedy_outputs.json) holds the greedy token ids of the tiny
random-weight model in float32 under each kernel route the CPU can run (the scanned reference
decoder; the unrolled decoder with the Pallas kernels in interpret mode, with float and with
FP8 weights and KV) and of the embedded SmolLM2 model. Regenerate it only for a change that is
meant to move outputs: `PYTHONPATH=tests python tests/engine/test_golden_outputs.py --write`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from dense_reference import random_flat
from engine_util import TINY, random_prompts
from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from checkpoints.model_state import build_model

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "greedy_outputs.json"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

# name -> (EngineConfig fields, build_model fields) of the tiny model's routes
TINY_ROUTES = {
    "tiny_scan_reference": ({"attention_impl": "reference", "unroll_layers": False}, {}),
    "tiny_unrolled_pallas": ({"attention_impl": "pallas", "unroll_layers": True},
                             {"unroll_layers": True}),
    "tiny_unrolled_pallas_fp8": ({"attention_impl": "pallas", "unroll_layers": True,
                                  "weights": "fp8", "kv_dtype": "fp8"},
                                 {"unroll_layers": True, "fp8": True}),
}
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                   "Once upon a time, in a small village,"]


def tiny_outputs(route: str) -> list[list[int]]:
    engine_kw, build_kw = TINY_ROUTES[route]
    graphdef, params = build_model(TINY, random_flat(TINY, seed=11, std=0.08), jnp.float32,
                                   **build_kw)
    cfg = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                       page_size=4, **engine_kw)
    engine = Engine(TINY, cfg, graphdef, params)
    ids = [engine.add_request(p, GREEDY) for p in random_prompts(6, seed=5)]
    done = engine.run_until_done(use_tqdm=False)
    return [list(done[i].token_ids) for i in ids]


def smollm2_outputs() -> list[list[int]]:
    llm = LLM("smollm2", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64)
    return [list(o.token_ids) for o in llm.generate(SMOLLM2_PROMPTS, GREEDY, use_tqdm=False)]


def generate() -> dict:
    out = {route: tiny_outputs(route) for route in TINY_ROUTES}
    out["smollm2"] = smollm2_outputs()
    return out


@pytest.fixture(scope="module")
def fixture():
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("route", sorted(TINY_ROUTES))
def test_tiny_greedy_outputs_match_fixture(fixture, route):
    assert tiny_outputs(route) == fixture[route]


def test_smollm2_greedy_outputs_match_fixture(fixture):
    assert smollm2_outputs() == fixture["smollm2"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=tests python tests/engine/test_golden_outputs.py --write")
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(generate(), indent=1) + "\n")
    print(f"wrote {FIXTURE}")
