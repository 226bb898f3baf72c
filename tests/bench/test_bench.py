"""Every bench suite runs end to end on the tiny model on the CPU and writes a valid results
file (bench/README.md), by default outside the tree. No timing asserts: only that
the numbers exist and add up. (batching, throughput: test_bench_batching.py,
test_bench_throughput.py; serving: tests/serve/test_serve.py, against its server.)"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench import cli, decode

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ["--model", "tiny", "--git", "test-sha", "--reps", "2"]


def _load(path: Path, suite: str) -> dict:
    result = json.loads(path.read_text())
    for key in ("suite", "device", "jax", "git", "date", "command", "rows"):
        assert key in result, key
    assert result["suite"] == suite and result["git"] == "test-sha"
    assert result["command"].startswith("jaxinfer bench ")
    assert result["rows"]
    return result


def _positive(row, *keys):
    for k in keys:
        assert row[k] > 0, (k, row)


def _rounded_ratio(value, num, den):
    """value is round(num / d, 4) for a d that the row keeps as den = round(d, 4) (ms): on a
    noisy CPU the back-to-back step can come out at a few us, where den's rounding alone moves
    the ratio by percent."""
    lo, hi = num / (den + 5e-5), num / max(den - 5e-5, 1e-9)
    assert lo - 5e-5 <= value <= hi + 5e-5, (value, num, den)


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_default_output_is_outside_the_tree(tmp_path, monkeypatch):
    """Without --out a run leaves bench/results alone and writes the default place (a temp
    folder: monkeypatched here so parallel runs do not meet)."""
    assert cli.default_out("decode") == (Path(tempfile.gettempdir()) / "jaxinfer-bench" /
                                         "decode.json")
    assert ROOT not in cli.default_out("decode").parents
    monkeypatch.setattr(cli, "DEFAULT_OUT_DIR", tmp_path / "jaxinfer-bench")
    before = _snapshot(cli.RESULTS_DIR)
    assert cli.main(["fp8_matmul", "--git", "test-sha", "--shapes", "64x128", "--ms", "1",
                     "--samples", "1", "--max-rotate", "2"]) == 0
    assert _snapshot(cli.RESULTS_DIR) == before
    result = _load(tmp_path / "jaxinfer-bench" / "fp8_matmul.json", "fp8_matmul")
    assert result["command"] == ("jaxinfer bench fp8_matmul --git test-sha --shapes 64x128 "
                                 "--ms 1 --samples 1 --max-rotate 2")


def test_committed_results_name_their_command_git_and_device():
    paths = sorted(cli.RESULTS_DIR.glob("*.json"))
    assert {p.stem for p in paths} == set(cli.SUITES)   # one current record per suite
    for path in paths:
        result = json.loads(path.read_text())
        assert result["suite"] == path.stem, path
        assert result["command"] and result["git"] and result["device"], path
        assert result["rows"], path


def test_help_lists_every_suite_and_shows_defaults(capsys):
    from jaxinfer.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in cli.SUITES) and "kernels" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "decode", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 1,8,64,256 on a GPU, 1,4 on the CPU)" in text
    assert "(default: 10)" in text and "bench/decode.json" in text


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


def test_decode_append_keeps_each_runs_command(tmp_path):
    out = tmp_path / "decode.json"
    for git in ("first", "second"):
        assert cli.main(["decode", "--model", "tiny", "--git", git, "--reps", "2", "--out",
                         str(out), "--batch-sizes", "1", "--contexts", "9", "--page-size",
                         "4", "--append"]) == 0
    result = json.loads(out.read_text())
    assert [r["git"] for r in result["runs"]] == ["first", "second"]
    assert [r["run"] for r in result["rows"]] == [0, 1] and result["git"] == "first"


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


def test_compile_suite_cold_and_warm(tmp_path):
    # A child process: the suite sets the process-wide persistent cache dir.
    out = tmp_path / "compile.json"
    subprocess.run([sys.executable, "-m", "bench.cli", "compile", *ENGINE[:4], "--out", str(out),
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
    # Both sampling variants of both buckets and the page copy: each bucket's greedy step and
    # sampling step's forward pass, the sampling of one row (both buckets have one), the
    # page copy; the warm start loads the five steps from the executable store (no
    # tracing) and the page copy from JAX's cache.
    assert cold["executables"] == warm["executables"] == 6 and cold["buckets"] == 2
    assert cold["cache_hits"] == 0 and cold["loaded_from_store"] == 0
    assert warm["loaded_from_store"] == 5 and warm["cache_hits"] >= 1
    assert result["cold_total_s"] == cold["wall_s"] > 0 and result["warm_total_s"] > 0
    # Spawn to first token covers loading and compiling; the first step compiles nothing.
    for got in (cold, warm):
        assert got["compiles_after_warmup"] == 0
        assert got["to_first_token_s"] > got["load_s"] + got["wall_s"] > 0
        # tracing (or loading from the store), then compiling: parts of the warm-up's wall
        assert 0 < got["tracing_s"] and 0 <= got["compiling_s"]
        assert got["tracing_s"] + got["compiling_s"] <= got["wall_s"]
    assert cold["compiling_s"] > 0      # warm: the store held every step
    assert result["cold_to_first_token_s"] == cold["to_first_token_s"]
    assert any((tmp_path / "cache").iterdir())


def test_compile_suite_startup_only(tmp_path):
    out = tmp_path / "compile.json"
    subprocess.run([sys.executable, "-m", "bench.cli", "compile", *ENGINE[:4], "--out", str(out),
                    "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--startup-only"],
                   check=True, cwd=ROOT)
    result = json.loads(out.read_text())
    assert "cold_serial_sum_s" not in result
    assert [r["phase"] for r in result["rows"]] == ["cold", "warm"]
    assert result["rows"][1] == result["warm_startup"] | {"phase": "warm"}
    warm = result["warm_startup"]
    assert warm["executables"] == 6 and warm["loaded_from_store"] + warm["cache_hits"] >= 6
    assert result["warm_to_first_token_s"] > 0


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


def test_paged_attention_suite_rows_and_plot(tmp_path):
    """Under its alias `kernels`: the Pallas kernel in interpret mode beside the reference,
    bf16 and both FP8 scale forms, with the FP8-over-bf16 ratio."""
    out = tmp_path / "paged_attention.json"
    assert cli.main(["kernels", "--git", "test-sha", "--out", str(out), "--batch-sizes", "1",
                     "--contexts", "32"]) == 0
    result = _load(out, "paged_attention")
    assert result["command"].startswith("jaxinfer bench kernels")
    got = [(r["impl"], r["kv_dtype"], r.get("kv_scales")) for r in result["rows"]]
    assert got == [("jaxinfer", "bf16", None), ("xla_reference", "bf16", None),
                   ("jaxinfer", "fp8", "static"), ("jaxinfer", "fp8", "token"),
                   ("xla_reference", "fp8", "token")]
    for r in result["rows"]:
        assert "error" not in r and r["us"] > 0 and not any(k.endswith("_device") for k in r)
    assert all(r["vs_bf16_kv"] > 0 for r in result["rows"][2:4])
    assert (tmp_path / "paged_attention_bandwidth.png").stat().st_size > 0


def test_fp8_matmul_suite_rows(tmp_path):
    out = tmp_path / "fp8_matmul.json"
    assert cli.main(["fp8_matmul", "--git", "test-sha", "--out", str(out), "--shapes",
                     "128x64,64x32", "--ms", "1,8", "--samples", "1", "--max-rotate",
                     "2"]) == 0
    result = _load(out, "fp8_matmul")
    assert [(r["K"], r["N"], r["M"], r["impl"]) for r in result["rows"]][:3] == [
        (128, 64, 1, "jaxinfer"), (128, 64, 1, "xla_bf16"), (128, 64, 1, "xla_fp8_dequant")]
    assert len(result["rows"]) == 2 * 2 * 3
    for r in result["rows"]:
        assert r["us"] > 0 and r["rel_err"] < 2e-2 and r["vs_bf16"] > 0, r
    assert (tmp_path / "fp8_matmul_time.png").stat().st_size > 0


@pytest.mark.parametrize("suite", ["decode", "serving", "paged_attention", "fp8_matmul"])
def test_plots_draw_from_the_committed_records(suite, tmp_path):
    from bench import plots

    path = tmp_path / f"{suite}.json"
    path.write_text((cli.RESULTS_DIR / f"{suite}.json").read_text())
    png = plots.write(path)
    assert png.parent == tmp_path and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
