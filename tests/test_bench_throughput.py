"""CPU smoke test of bench/throughput.py on the tiny model with FP8 weights and FP8 KV: the
results file has the BENCH.md schema, every request emits exactly output_len tokens, nothing
compiles or is preempted while timing, steps are split by kind, --profile-steps adds a
profile of its window, and --time-limit-s leaves a partial row. No timing
asserts."""
import json

import pytest

from bench import throughput

ARGV = ["--model", "tiny", "--weights", "fp8", "--kv-dtype", "fp8", "--input-len", "12",
        "--output-len", "6", "--num-requests", "5", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "16", "--git", "abc123"]


def test_workload_is_seeded_and_fixed_length():
    args = throughput.parse_args(["--input-len", "7", "--output-len", "3", "--num-requests", "4",
                                  "--seed", "5", "--out", "x.json"])
    a, b = throughput.make_workload(args, 512), throughput.make_workload(args, 512)
    assert a == b and len(a) == 4 and len({tuple(p) for p, _ in a}) == 4
    assert all(len(p) == 7 and n == 3 and all(3 <= t < 512 for t in p) for p, n in a)


def test_throughput_bench_schema(tmp_path):
    out = tmp_path / "throughput.json"
    result = throughput.main(ARGV + ["--profile-steps", "3:4", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    for key in ("suite", "device", "jax", "git", "date", "command", "rows"):
        assert result[key], key
    assert result["suite"] == "throughput" and result["git"] == "abc123"
    assert result["command"].startswith("python -m bench.throughput --model tiny")
    [row] = result["rows"]
    assert (row["model"], row["weights"], row["kv_dtype"]) == ("tiny", "fp8", "fp8")
    assert (row["input_len"], row["output_len"], row["num_requests"]) == (12, 6, 5)
    assert row["finished_requests"] == 5 and row["wrong_length"] == 0
    assert row["output_tokens"] == 5 * 6 and not row["partial"]
    assert row["compiles"] == 0 and row["preemptions"] == 0
    assert row["gpu_clocks"] is None or row["gpu_clocks"]["samples"] > 0   # None: no GPU
    assert row["output_tokens_per_s"] > 0
    assert row["total_tokens_per_s"] > row["output_tokens_per_s"]
    assert row["max_num_seqs"] == 2 and row["async_scheduling"] is True
    assert 0 < row["host_ms_per_step"] <= row["step_ms"] and row["steps"] > 0
    phases = row["host_phases_ms"]
    parts = {"prepare_arrays", "prepare_input", "prepare_transfer"}
    assert set(phases) == {"early_resolve", "schedule", "prepare", "dispatch", "commit",
                           "resolve", "wait"} | parts
    assert all(v >= 0 for v in phases.values()) and phases["dispatch"] > 0
    assert 0 < row["schedule_share"] < row["host_share"]
    assert all(phases[k] <= phases["prepare"] for k in parts) and phases["prepare_transfer"] > 0
    # every step but the first call's is charged to the step it waited for; the 5 prompts of
    # 12 tokens need mixed steps (budget 16), the later ones are decode-only (2 rows)
    kinds = row["step_kinds"]
    assert kinds["decode"]["steps"] + kinds["mixed"]["steps"] == row["steps"]
    assert kinds["decode"]["median_tokens"] <= 2 < kinds["mixed"]["median_tokens"] <= 16
    assert row["profile"]["first_step"] == 3 and row["profile"]["steps"] == 4
    assert row["profile"]["kernels_per_step"] > 0 and row["profile"]["top"]
    # --simulate replays the same schedule without the model: the same prefill steps; the
    # async engine's run takes two steps more here (the H200 run: one, 2,309 vs 2,308)
    sim = throughput.simulate(throughput.parse_args(ARGV + ["--simulate"]))
    assert sim["steps_with_prefill"] == kinds["mixed"]["steps"]
    assert 0 <= row["steps"] - sim["steps"] <= 2
    assert sim["num_pages"] == row["num_pages"]


class _Clock:
    """perf_counter advancing one second per call: the deadline falls at a known call."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self):
        self.t += 1.0
        return self.t


def test_time_limit_writes_partial_row(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput, "time", _Clock())
    # No ahead-of-time compile (the buckets the few steps use compile on demand): keeps the
    # test short; compiles are not checked here.
    monkeypatch.setattr(throughput.Engine, "warmup",
                        lambda self, progress=True, **kw: {"compiles": 0, "seconds": 0.0,
                                                     "buckets": 0})
    out = tmp_path / "throughput.json"
    # Clock calls: main start 1 (deadline 9), load 2, timer start 3, queued 4, then one per
    # step before dispatch: 5..8 dispatch, 9 stops.
    result = throughput.main(ARGV + ["--time-limit-s", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    [row] = result["rows"]
    assert row["partial"] is True and row["steps"] == 4
    assert row["finished_requests"] < 5 and 0 < row["output_tokens"] < 5 * 6
    assert row["wall_s"] == 7.0 and row["output_tokens_per_s"] == round(
        row["output_tokens"] / 7.0, 2)


def test_append_adds_a_row(tmp_path):
    out = tmp_path / "throughput.json"
    small = ["--model", "tiny", "--input-len", "4", "--output-len", "2", "--num-requests", "1",
             "--max-num-seqs", "1", "--max-num-batched-tokens", "8", "--out", str(out)]
    throughput.main(small + ["--git", "first"])
    result = throughput.main(small + ["--git", "second", "--append", "--lm-head", "int8"])
    assert json.loads(out.read_text()) == result
    assert [r["git"] for r in result["rows"]] == ["first", "second"]
    assert [r.get("lm_head") for r in result["rows"]] == [None, "int8"]
    assert result["git"] == "first" and "--append" in result["rows"][1]["command"]
    assert all(r["output_tokens"] == 2 and r["steps"] > 0 for r in result["rows"])


def test_simulate_prints_its_row_and_needs_no_out(capsys):
    result = throughput.main(["--simulate", "--input-len", "40", "--output-len", "30",
                              "--num-requests", "12", "--max-num-seqs", "4",
                              "--max-num-batched-tokens", "64"])
    [row] = result["rows"]
    assert json.loads(capsys.readouterr().out) == row and row["simulated"]
    assert row["steps"] == row["steps_with_prefill"] + row["decode_only_steps"]
    # 12 x 30 output tokens over at most 4 rows a step: at least 90 steps
    assert row["steps"] >= 90 and 0 < row["decode_only_mean_rows"] <= 4
    assert row["predicted_output_tokens_per_s"] == pytest.approx(360 / row["predicted_s"],
                                                                  rel=0.01)
    with pytest.raises(SystemExit):
        throughput.parse_args(["--num-requests", "3"])       # a timed run needs --out


def test_step_model_grows_with_tokens_and_context():
    f = throughput.model_step_ms
    tokens = [1, 8, 100, 256, 488, 1000, 2048, 4096, 8192]
    times = [f(t, 0) for t in tokens]
    assert all(a < b for a, b in zip(times[1:], times[2:]))     # flat below the first point
    assert f(4096, 0) - f(2048, 0) == pytest.approx(f(8192, 0) - f(6144, 0))  # linear past it
    assert f(512, 512 * 1500) > f(512, 512 * 1000) > f(512, 0)
