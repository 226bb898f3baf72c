"""CPU smoke test of bench/lora.py on the tiny model: the results file has the
bench/README.md schema, every mode serves the whole workload with the adapters asked for,
and nothing compiles while timing. No timing asserts."""
import json

from bench import cli


def test_lora_suite_schema(tmp_path):
    out = tmp_path / "lora.json"
    argv = ["lora", "--model", "tiny", "--batch-sizes", "1,3", "--adapters", "2", "--rank",
            "4", "--input-len", "6", "--output-len", "5", "--max-num-batched-tokens", "32",
            "--git", "abc123", "--out", str(out)]
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


def test_suites_refuse_adapters_they_would_not_load(capsys):
    from jaxinfer.cli import main
    assert main(["bench", "decode", "--model", "tiny", "--lora", "a=/nowhere"]) == 2
    assert "load no LoRA adapters" in capsys.readouterr().err
