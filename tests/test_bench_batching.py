"""CPU smoke test of bench/batching.py on the tiny model: the results file has the BENCH.md
schema, both modes serve the whole workload, and nothing compiles while timing. No timing
asserts."""
import json

import numpy as np

from bench import batching

ROW_KEYS = {"mode", "max_batch", "requests", "output_tokens", "steps", "wall_s",
            "output_tokens_per_s", "output_tokens_per_step", "host_ms_per_step", "step_ms",
            "host_share", "schedule_share", "host_phases_ms", "compiles_during_run",
            "preemptions", "warmup_s"}


def test_workload_is_seeded_and_within_ranges():
    args = batching.parse_args(["--num-requests", "50", "--prompt-len", "4,40",
                                "--output-len", "2,9", "--seed", "7", "--prompt-median", "12",
                                "--output-median", "4"])
    a, b = batching.make_workload(args, 512), batching.make_workload(args, 512)
    assert a == b
    plens, olens = np.array([len(p) for p, _ in a]), np.array([o for _, o in a])
    assert 4 <= plens.min() and plens.max() <= 40 and len(set(plens)) > 5
    assert 2 <= olens.min() and olens.max() <= 9
    assert all(3 <= t < 512 for p, _ in a for t in p)


def test_batching_bench_schema(tmp_path):
    out = tmp_path / "batching.json"
    argv = ["--model", "tiny", "--num-requests", "5", "--max-batch", "2",
            "--max-num-batched-tokens", "16", "--prompt-len", "3,20", "--prompt-median", "8",
            "--output-len", "2,10", "--output-median", "5", "--git", "abc123",
            "--out", str(out)]
    result = batching.main(argv)
    assert json.loads(out.read_text()) == result
    for key in ("suite", "device", "jax", "git", "date", "command", "rows"):
        assert result[key], key
    assert result["suite"] == "batching" and result["git"] == "abc123"
    assert result["command"].startswith("python -m bench.batching --model tiny")
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


def test_simulate_replays_the_schedule_without_a_model(capsys):
    argv = ["--simulate", "--num-requests", "40", "--max-batch", "8",
            "--max-num-batched-tokens", "64", "--prompt-len", "4,60", "--prompt-median", "16",
            "--output-len", "2,40", "--output-median", "6"]
    rows = batching.main(argv)["rows"]
    assert [r["mode"] for r in rows] == ["continuous", "static"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == rows
    args = batching.parse_args(argv)
    workload = batching.make_workload(args, 1000)
    prompt_tokens = sum(len(p) for p, _ in workload)
    for r in rows:
        assert r["steps"] == r["steps_with_prefill"] + r["decode_only_steps"]
        assert sum(r["decode_only_steps_by_rows"].values()) == r["decode_only_steps"]
        assert 0 < r["decode_only_mean_rows"] <= 8
        # every prompt token but the ones a one-token chunk carried sits in a prefill step
        assert r["steps_with_prefill"] * r["prefill_tokens_per_such_step"] <= prompt_tokens
    continuous, static = rows
    assert continuous["steps"] < static["steps"]
    assert continuous["decode_only_mean_rows"] > static["decode_only_mean_rows"]
