"""CPU smoke test of bench/batching.py on the tiny model: the results file has the
bench/README.md schema, both modes serve the whole workload, and nothing compiles while
timing. No timing asserts."""
import argparse
import json

import numpy as np

from bench import batching, cli

ROW_KEYS = {"mode", "max_batch", "requests", "output_tokens", "steps", "wall_s",
            "output_tokens_per_s", "output_tokens_per_step", "host_ms_per_step", "step_ms",
            "host_share", "schedule_share", "host_phases_ms", "compiles_during_run",
            "preemptions", "warmup_s"}


def test_workload_is_seeded_and_within_ranges():
    args = argparse.Namespace(num_requests=50, prompt_len=(4, 40), output_len=(2, 9), seed=7,
                              prompt_median=12.0, output_median=4.0, sigma=1.0)
    a, b = batching.make_workload(args, 512), batching.make_workload(args, 512)
    assert a == b
    plens, olens = np.array([len(p) for p, _ in a]), np.array([o for _, o in a])
    assert 4 <= plens.min() and plens.max() <= 40 and len(set(plens)) > 5
    assert 2 <= olens.min() and olens.max() <= 9
    assert all(3 <= t < 512 for p, _ in a for t in p)


def test_batching_suite_schema(tmp_path):
    out = tmp_path / "batching.json"
    argv = ["batching", "--model", "tiny", "--num-requests", "5", "--max-batch", "2",
            "--max-num-batched-tokens", "16", "--prompt-len", "3,20", "--prompt-median", "8",
            "--output-len", "2,10", "--output-median", "5", "--git", "abc123",
            "--out", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    for key in ("suite", "device", "jax", "git", "date", "command", "rows"):
        assert result[key], key
    assert result["suite"] == "batching" and result["git"] == "abc123"
    assert result["command"].startswith("jaxinfer bench batching --model tiny")
    rows = result["rows"]
    assert [r["mode"] for r in rows] == ["continuous", "static"]
    want_tokens = result["workload"]["output_tokens"]
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["max_batch"] == 2 and r["requests"] == 5
        assert r["output_tokens"] == want_tokens   # ignore_eos: every request runs its length
        assert r["compiles_during_run"] == 0 and r["preemptions"] == 0
        assert r["output_tokens_per_s"] > 0 and 0 < r["host_ms_per_step"] <= r["step_ms"]
        assert 0 < r["host_share"] <= 1
        assert 0 < r["schedule_share"] < r["host_share"]
        assert r["host_phases_ms"]["schedule"] > 0 and r["host_phases_ms"]["dispatch"] > 0
    # Static groups run to completion one after the other: never fewer steps than continuous.
    assert rows[1]["steps"] >= rows[0]["steps"]
    assert set(result["continuous_over_static"]) == {"2"}
    assert result["continuous_over_static"]["2"] > 0
