"""Every bench suite runs end to end on the tiny model on the CPU and writes a valid results
file (shared/BENCH.md's format). No timing asserts: only that the numbers exist and add up."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli, decode

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ["--model", "tiny", "--git", "test-sha", "--reps", "2"]


def _load(path: Path, suite: str) -> dict:
    result = json.loads(path.read_text())
    for key in ("suite", "device", "jax", "git", "date", "command", "rows"):
        assert key in result, key
    assert result["suite"] == suite and result["git"] == "test-sha"
    assert result["rows"]
    return result


def _positive(row, *keys):
    for k in keys:
        assert row[k] > 0, (k, row)


def _rounded_ratio(value, num, den):
    """value was round(num / d, 4) for a d that the row keeps as den = round(d, 4) (ms): on a
    noisy CPU the back-to-back step can come out at a few us, where den's rounding alone moves
    the ratio by percent."""
    lo, hi = num / (den + 5e-5), num / max(den - 5e-5, 1e-9)
    assert lo - 5e-5 <= value <= hi + 5e-5, (value, num, den)


def test_decode_suite_rows_and_plot(tmp_path):
    out = tmp_path / "decode.json"
    assert cli.main(["decode", *ENGINE, "--out", str(out), "--batch-sizes", "1,2",
                     "--contexts", "9,40", "--page-size", "4"]) == 0
    result = _load(out, "decode")
    assert {"copy_TBps", "read_TBps", "gemm_TFLOPs"} <= set(result["ceilings"])
    assert sorted((r["batch"], r["context"]) for r in result["rows"]) == [
        (1, 9), (1, 40), (2, 9), (2, 40)]
    for r in result["rows"]:
        assert r["model"] == "tiny" and r["weights"] == "f32" and r["kv_dtype"] == "f32"
        assert r["gpu_clocks"] is None or r["gpu_clocks"]["samples"] > 0   # None: no GPU
        _positive(r, "step_ms", "step_ms_device", "dispatch_ms", "tokens_per_s", "mbu",
                  "bytes_per_step", "flops_per_step", "intensity_flop_per_byte")
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3, rel=1e-2)
        ref_floor_ms = r["bytes_per_step"] / (decode.REF_READ_TBPS * 1e12) * 1e3
        _rounded_ratio(r["mbu_ref"], ref_floor_ms, r["step_ms"])
        _rounded_ratio(r["mbu_device_ref"], ref_floor_ms, r["step_ms_device"])
    by = {(r["batch"], r["context"]): r for r in result["rows"]}
    assert by[2, 40]["bytes_per_step"] > by[2, 9]["bytes_per_step"] > by[1, 9]["bytes_per_step"]
    png = tmp_path / "decode_roofline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fusion_suite_compares_fused_unfused_and_cmdbuf_off(tmp_path):
    out = tmp_path / "fusion.json"
    assert cli.main(["fusion", *ENGINE, "--out", str(out), "--batch-sizes", "1",
                     "--contexts", "12", "--page-size", "4"]) == 0
    result = _load(out, "fusion")
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"fused", "unfused", "fused_cmdbuf_off"}
    for r in rows.values():
        _positive(r, "step_ms", "kernels_per_step", "kernels_per_layer")
    assert rows["unfused"]["kernels_per_layer"] > rows["fused"]["kernels_per_layer"]
    assert result["fused_over_unfused_batch1"] == pytest.approx(
        rows["unfused"]["step_ms"] / rows["fused"]["step_ms"], rel=1e-2)


def test_prefill_suite_ttft_and_padding(tmp_path):
    out = tmp_path / "prefill.json"
    assert cli.main(["prefill", *ENGINE, "--out", str(out), "--contexts", "5,20",
                     "--max-num-batched-tokens", "16"]) == 0
    rows = _load(out, "prefill")["rows"]
    assert [r["prompt_len"] for r in rows] == [5, 20]
    for r in rows:
        _positive(r, "ttft_ms", "prefill_tokens_per_s")
        assert 0 <= r["padding_fraction"] < 1
    assert rows[0]["steps"] == 1 and rows[1]["steps"] == 2   # 20 tokens: two 16-token chunks
    assert rows[0]["padding_fraction"] == pytest.approx(11 / 16)


def test_compile_suite_cold_and_warm(tmp_path):
    # A child process: the suite sets the process-wide persistent cache dir.
    out = tmp_path / "compile.json"
    subprocess.run([sys.executable, "-m", "bench.cli", "compile", *ENGINE, "--out", str(out),
                    "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                    "--cache-dir", str(tmp_path / "cache")], check=True, cwd=ROOT)
    result = _load(out, "compile")
    assert [r["bucket"] for r in result["rows"]] == ["decode T1 B1 W128", "mixed T16 B1 W128"]
    for r in result["rows"]:
        _positive(r, "trace_s", "lower_s", "compile_s", "kernels_per_step", "temp_MB")
        assert r["cache_hit"] is False
    assert result["kernels_per_layer"] == result["rows"][0]["kernels_per_layer"] > 0
    assert result["cold_serial_sum_s"] > 0
    cold, warm = result["cold_startup"], result["warm_startup"]
    # Both sampling variants of both buckets; the warm start finds all four in the cache.
    assert cold["executables"] == warm["executables"] == 4 and cold["buckets"] == 2
    assert cold["cache_hits"] == 0 and warm["cache_hits"] >= 4
    assert result["cold_total_s"] == cold["wall_s"] > 0 and result["warm_total_s"] > 0
    assert any((tmp_path / "cache").iterdir())


def test_profile_suite_breaks_the_step_down(tmp_path):
    """On the CPU the profiler sees host-side XLA ops instead of GPU kernels: the suite must
    still run end to end and write consistent per-step sums."""
    out = tmp_path / "profile.json"
    assert cli.main(["profile", *ENGINE, "--out", str(out), "--batch-sizes", "1,2",
                     "--contexts", "9", "--page-size", "4"]) == 0
    result = _load(out, "profile")
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(1, 9), (2, 9)]
    for r in result["rows"]:
        _positive(r, "kernels_per_step", "busy_ms_per_step", "unprofiled_ms_per_step",
                  "dispatch_ms_per_step")
        parts = sum(r[f"{c}_ms"] for c in ("gemm", "attention", "sampling", "copy", "other"))
        assert abs(parts - r["busy_ms_per_step"]) <= 1e-3 * max(1.0, parts) + 5e-4
        assert r["top"] and r["families"] and r["host_top_ms_per_step"]


def test_host_step_times_every_phase():
    from bench import host_step
    result = host_step.main(["--rows", "8", "--context", "200", "--steps", "3"])
    assert set(result) == {*host_step.PHASES, "total"}
    _positive(result, *host_step.PHASES)
    assert result["total"] == pytest.approx(sum(result[p] for p in host_step.PHASES), abs=0.01)
