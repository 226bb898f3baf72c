"""CPU smoke test of bench/lora.py on the tiny model: the results file has the
bench/README.md schema, every mode serves the whole workload with the adapters asked for,
and nothing compiles while timing. No timing asserts."""
import json

from bench import cli


def test_lora_suite_schema(tmp_path):
    out = tmp_path / "lora.json"
    argv = ["lora", "--model", "tiny", "--batch-sizes", "1,3", "--adapters", "2", "--rank",
            "4", "--input-len", "6", "--output-len", "5", "--max-num-batched-tokens", "32",
            "--git", "abc123", "--profile", "--out", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    for key in ("suite", "device", "jax", "git", "date", "command", "rows"):
        assert result[key], key
    assert result["suite"] == "lora" and result["command"].startswith("jaxinfer bench lora")
    assert (result["adapters"], result["rank"]) == (2, 4)
    rows = result["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [
        (b, m) for b in (1, 3) for m in ("base", "lora", "lora_no_rows")]
    for r in rows:
        assert r["output_tokens"] == 5 * r["batch"]     # ignore_eos: each runs its length
        assert r["compiles_during_run"] == 0
        assert r["output_tokens_per_s"] > 0 and r["step_ms"] > 0
        base = next(b for b in rows if b["batch"] == r["batch"] and b["mode"] == "base")
        assert abs(r["vs_base"] - r["output_tokens_per_s"] / base["output_tokens_per_s"]) < 1e-3
    assert [r["adapters"] for r in rows if r["mode"] == "lora"] == [1, 2]
    # --profile: each row's run again under the profiler (on the CPU, XLA's host-side ops)
    for r in rows:
        prof = r["profile"]
        assert prof["kernels_per_step"] > 0 and prof["families"], r["mode"]
        assert all(f["calls_per_step"] > 0 for f in prof["families"])


def test_suites_refuse_adapters_they_would_not_load(capsys):
    from jaxinfer.cli import main
    assert main(["bench", "decode", "--model", "tiny", "--lora", "a=/nowhere"]) == 2
    assert "load no LoRA adapters" in capsys.readouterr().err


def test_lora_kernels_suite_rows(tmp_path):
    """bench/lora_kernels.py on the tiny model's shapes (kernels interpreted): a row per step
    size and group with XLA's and the kernels' times and whether the model routes there."""
    out = tmp_path / "lora_kernels.json"
    assert cli.main(["lora_kernels", "--model", "tiny", "--rows", "1,8", "--sets", "1",
                     "--git", "abc123", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "lora_kernels" and (result["slots"], result["rank"]) == (8, 16)
    rows = result["rows"]
    assert [(r["T"], r["group"]) for r in rows] == [
        (t, g) for t in (1, 8) for g in ("qkv", "o", "gateup", "down")]
    for r in rows:
        assert r["xla_us"] > 0 and r["us"] > 0 and r["routed"] is True
        assert abs(r["speedup"] - r["xla_us"] / r["us"]) < 0.01 * r["speedup"]
