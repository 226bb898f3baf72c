"""CPU smoke test of bench/speculative.py on the tiny model: the results file has the
bench/README.md schema, the replay proposer's proposals all hold and the outputs equal the
plain run's, the verify-step timing covers the batch sizes that speculate, and nothing
compiles while timing. No timing asserts."""
import json

import numpy as np
import pytest

from bench import cli


def test_speculative_suite_schema(tmp_path):
    out = tmp_path / "speculative.json"
    argv = ["speculative", "--model", "tiny", "--batch-sizes", "1,3", "--input-len", "6",
            "--output-len", "9", "--num-speculative-tokens", "3",
            "--speculative-disable-batch-size", "2", "--context", "32", "--reps", "2",
            "--git", "abc123", "--out", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    for key in ("suite", "device", "jax", "git", "date", "command", "rows", "step_cost"):
        assert result[key], key
    assert result["suite"] == "speculative" and result["k"] == 3
    # Batch 3 is above the disable size: only batch 1 speculates, so only it is timed.
    assert [(r["batch"], r["k"]) for r in result["step_cost"]] == [(1, 3)]
    cost = result["step_cost"][0]
    assert cost["verify_vs_decode"] == pytest.approx(
        cost["verify_step_ms"] / cost["decode_step_ms"], rel=1e-2)
    rows = result["rows"]
    assert [(r["batch"], r["workload"], r["mode"]) for r in rows] == [
        (b, "replay", m) for b in (1, 3) for m in ("plain", "replay")]
    for r in rows:
        assert r["output_tokens"] == 9 * r["batch"] and r["compiles_during_run"] == 0
    spec1, spec3 = (r for r in rows if r["mode"] == "replay")
    assert spec1["identical"] and spec1["acceptance_rate"] == 1.0
    assert spec1["replay_rounds"] == 1      # plain's outputs are the verify steps' own here
    assert spec1["mean_accepted_length"] > 3 and spec1["steps"] < rows[0]["steps"]
    assert spec3["identical"] and spec3["drafts"] == 0     # switched itself off


def test_speculative_suite_needs_k():
    with pytest.raises(SystemExit, match="num-speculative-tokens"):
        cli.main(["speculative", "--model", "tiny", "--num-speculative-tokens", "0"])


def test_replay_fixed_point_reaches_the_verify_steps_continuation():
    """Replay started from wrong continuations (every third token changed): each run agrees
    with the greedy continuation further than the last, until one keeps every proposal; the
    proposer then replays exactly the greedy outputs, and a run with it keeps all of them."""
    from bench.speculative import ReplayProposer, measure, replay_fixed_point
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine
    from jaxinfer.request import SamplingParams
    from engine_util import TINY, tiny_model

    graphdef, params = tiny_model()
    cfg = TINY
    ecfg = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                        enable_prefix_caching=False, num_speculative_tokens=3)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, 6).tolist()}
               for _ in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = Engine(cfg, ecfg.replace(num_speculative_tokens=0), graphdef, params)
    _, want = measure(plain, [prompts], greedy)
    wrong = [[(t + 1) % cfg.vocab_size if i % 3 == 2 else t for i, t in enumerate(w)]
             for w in want]
    spec = Engine(cfg, ecfg, graphdef, params)
    rounds = replay_fixed_point(spec, prompts, [prompts], wrong, greedy, 6)
    assert 1 < rounds <= 5
    assert isinstance(spec.proposer, ReplayProposer)
    assert [spec.proposer.continuations[tuple(p["prompt_token_ids"])] for p in prompts] == want
    row, outs = measure(spec, [prompts], greedy)
    assert outs == want and row["acceptance_rate"] == 1.0
