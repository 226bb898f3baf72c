"""CPU smoke test of bench/throughput.py on the tiny model with FP8 weights and FP8 KV: the
results file has the bench/README.md schema, every request emits exactly output_len tokens,
nothing compiles or is preempted while timing, steps are split by kind, --profile-steps adds
a profile of its window, and --time-limit-s leaves a partial row. No timing asserts."""
import argparse
import json

from bench import cli, throughput

ARGV = ["throughput", "--model", "tiny", "--weights", "fp8", "--kv-dtype", "fp8",
        "--input-len", "12", "--output-len", "6", "--num-requests", "5", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "16", "--git", "abc123"]


def test_workload_is_seeded_and_fixed_length():
    args = argparse.Namespace(input_len=7, output_len=3, num_requests=4, seed=5)
    a, b = throughput.make_workload(args, 512), throughput.make_workload(args, 512)
    assert a == b and len(a) == 4 and len({tuple(p) for p, _ in a}) == 4
    assert all(len(p) == 7 and n == 3 and all(3 <= t < 512 for t in p) for p, n in a)


def test_throughput_suite_schema(tmp_path):
    out = tmp_path / "throughput.json"
    assert cli.main(ARGV + ["--profile-steps", "3:4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("suite", "device", "jax", "git", "date", "command", "rows"):
        assert result[key], key
    assert result["suite"] == "throughput" and result["git"] == "abc123"
    assert result["command"].startswith("jaxinfer bench throughput --model tiny")
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
    assert all(v >= 0 for v in phases.values()) and phases["dispatch"] > 0
    assert 0 < row["schedule_share"] < row["host_share"]
    # every step but the first call's is charged to the step it waited for; the 5 prompts of
    # 12 tokens need mixed steps (budget 16), the later ones are decode-only (2 rows)
    kinds = row["step_kinds"]
    assert kinds["decode"]["steps"] + kinds["mixed"]["steps"] == row["steps"]
    assert kinds["decode"]["median_tokens"] <= 2 < kinds["mixed"]["median_tokens"] <= 16
    assert row["profile"]["first_step"] == 3 and row["profile"]["steps"] == 4
    assert row["profile"]["kernels_per_step"] > 0 and row["profile"]["top"]


def test_api_row_beside_the_harness_row(tmp_path):
    """--api: the same workload through LLM(...) and its first generate() in the same run,
    every request complete, nothing compiled inside the call (LLM warmed every bucket)."""
    out = tmp_path / "throughput.json"
    assert cli.main(ARGV + ["--api", "--out", str(out)]) == 0
    harness, api = json.loads(out.read_text())["rows"]
    assert (harness["path"], api["path"]) == ("harness", "LLM.generate")
    assert api["output_tokens"] == harness["output_tokens"] == 5 * 6
    assert api["wrong_length"] == 0 and api["compiles"] == 0
    assert api["output_tokens_per_s"] > 0 and api["construct_s"] >= 0 and api["steps"] > 0


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
    # Clock calls: run start 1 (deadline 9), load 2, timer start 3, queued 4, then one per
    # step before dispatch: 5..8 dispatch, 9 stops.
    assert cli.main(ARGV + ["--time-limit-s", "8", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["partial"] is True and row["steps"] == 4
    assert row["finished_requests"] < 5 and 0 < row["output_tokens"] < 5 * 6
    assert row["wall_s"] == 7.0 and row["output_tokens_per_s"] == round(
        row["output_tokens"] / 7.0, 2)
