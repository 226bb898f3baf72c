"""CPU smoke test of bench/host.py: the results file has its phases, each timed step is a
decode step of every row (the suite raises otherwise), and a context too short for the steps
asked for is refused. No timing asserts."""
import json

import pytest

from bench import cli, host

ARGV = ["host", "--max-num-seqs", "24", "--steps", "12", "--git", "abc123"]


def test_host_suite_schema(tmp_path):
    out = tmp_path / "host.json"
    assert cli.main(ARGV + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "host" and result["git"] == "abc123" and result["model"] == "tiny"
    [row] = result["rows"]
    assert row["rows"] == 24 and row["steps"] == 12
    phases = [row[f"{p}_ms"] for p in host.PHASES]
    assert all(v > 0 for v in phases) and row["python_loop_ms"] > 0
    assert row["total_ms"] == pytest.approx(sum(phases), abs=1e-3)


def test_a_context_too_short_for_the_steps_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="too short"):
        cli.main(ARGV + ["--max-model-len", "32", "--out", str(tmp_path / "h.json")])
