"""bench/probes/dispatch.py: the host's price of a dispatch and XLA's command-buffer
re-records (the log parse; the probe end to end on the CPU, where no command buffer exists)."""
import json

import jax
import pytest

from bench.probes import dispatch, host_step, outputs_ab

LOG = f"""I1202 command_buffer_thunk.cc:431] Evict command buffer thunk command buffers
{dispatch.MARK}fresh
I1202 command_buffer_thunk.cc:336] [0] Create/Update command buffer ... after 1 executions \
since last update; num_commands=36; updated_allocs=5; is_first_record=false
I1202 command_buffer_thunk.cc:362] [0] Updated command buffer in 104 us; num_commands=36
I1202 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=1
I1202 command_buffer_thunk.cc:336] [0] Create/Update ... num_commands=36; updated_allocs=6; x
I1202 command_buffer_thunk.cc:362] [0] Updated command buffer in 76 us; num_commands=36
I1202 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=1
I1202 command_buffer_thunk.cc:336] [0] Create/Update ... num_commands=36; updated_allocs=5; x
I1202 command_buffer_thunk.cc:362] [0] Updated command buffer in 90 us; num_commands=36
I1202 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=1
{dispatch.MARK}aliased
I1202 command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=2
"""


def test_parse_log_splits_at_the_marks():
    got = dispatch.parse_log(LOG)
    assert list(got) == ["fresh", "aliased"]   # the line before the first mark is nobody's
    assert got["fresh"] == {"executes": 3, "re_record_us_median": 90,
                            "re_records": {"36 commands, 5 moved": 2, "36 commands, 6 moved": 1}}
    assert got["aliased"] == {"executes": 1, "re_records": {}, "re_record_us_median": None}


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's answer")
def test_probe_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "dispatch.json"
    dispatch.main(["--arg-counts", "4,8", "--layers", "2", "--width", "64", "--calls", "3",
                   "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["probe"] == "dispatch" and res["command"].startswith(
        "python -m bench.probes.dispatch")
    args = [r for r in res["rows"] if r["part"] == "args"]
    assert [r["args"] for r in args] == [4, 8]
    assert all(r["used_ms"] > 0 and r["pruned_ms"] > 0 for r in args)
    cmdbuf = [r for r in res["rows"] if r["part"] == "cmdbuf"]
    assert [r["variant"] for r in cmdbuf] == list(dispatch.VARIANTS)
    for r in cmdbuf:   # the child ran each variant (its host time came back); no graphs here
        assert r["host_ms_per_call"] > 0 and r["executes"] == 0 and r["re_records"] == {}


def test_outputs_ab_measures_both_arms_on_the_cpu(tmp_path):
    out = tmp_path / "outputs_ab.json"
    outputs_ab.main(["--model", "tiny", "--context", "16", "--rounds", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["persistent_outputs"] for r in rows] == [True, False]
    for r in rows:
        assert all(r[m] > 0 and len(r["samples"][m]) == 1 for m in outputs_ab.METRICS), r


def test_host_step_times_the_batch1_step_on_the_cpu(tmp_path):
    out = tmp_path / "host_step.json"
    host_step.main(["--model", "tiny", "--context", "16", "--rounds", "2", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["rounds"]) == 2 and all(row[m] > 0 for m in host_step.METRICS), row
    assert row["synced_ms"] >= row["idle_enqueue_ms"] / 2, row   # a step includes its enqueue
