"""bench/gpu_clocks.py: nvidia-smi's samples parsed and summarized, the sampler process run
and stopped around a block (a stand-in script for nvidia-smi), and no nvidia-smi (the CPU)
giving None."""
import os
import stat
import time

import pytest

from bench import gpu_clocks

# H200 samples as --format=csv,noheader,nounits writes them
LINES = ["1980, 120.56, 0, 0x0000000000000000",         # idle: left out
         "1755, 690.39, 100, 0x0000000000000004",        # at the power cap
         "1845, 689.64, 97, 0x0000000000000004",
         "1965, 310.21, 27, 0x0000000000000000",
         "1470, [N/A], 100, 0x0000000000000048",         # thermal slowdown, no power reading
         "Field \"clocks_event_reasons.active\" is not a valid field to query."]


def test_parse_and_summarize():
    samples = gpu_clocks.parse(LINES)
    assert len(samples) == 5 and samples[4] == (1470.0, None, 100.0, 0x48)
    got = gpu_clocks.summarize(samples, 50)
    assert got == {"samples": 4, "interval_ms": 50, "sm_mhz_median": 1800.0,
                   "sm_mhz_p10": 1470.0, "sm_mhz_min": 1470.0, "sm_mhz_max": 1965.0,
                   "power_w_median": 689.6, "power_w_p90": 690.4, "power_w_max": 690.4,
                   "power_capped_share": 0.5, "slowdown_share": 0.25}
    assert gpu_clocks.summarize(gpu_clocks.parse(LINES[:1] + LINES[-1:]), 50) is None


def _fake_smi(path, instant: bool):
    """A stand-in for nvidia-smi: one sample per call, or a sample every 10 ms with -lms;
    without `instant` it rejects power.draw.instant as an older driver does."""
    reject = ("case \"$*\" in *instant*) echo 'Field \"power.draw.instant\" is not a valid "
              "field to query.'; exit 2 ;; esac\n") if not instant else ""
    path.write_text("#!/bin/sh\n" + reject +
                    "case \"$*\" in *-lms*) while true; do echo '1755, 690.39, 100, 0x4';"
                    " sleep 0.01; done ;; esac\n"
                    "echo '1755, 690.39, 100, 0x0000000000000004'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("instant", [True, False])
def test_monitor_runs_and_stops_the_sampler(tmp_path, instant):
    smi = _fake_smi(tmp_path / "fake-smi", instant)
    with gpu_clocks.ClockMonitor(interval_ms=10, smi=smi) as mon:
        proc = mon._proc
        deadline = time.monotonic() + 10
        while os.fstat(mon._out.fileno()).st_size < 100 and time.monotonic() < deadline:
            time.sleep(0.01)                        # until a few samples are written
        assert proc.poll() is None, "the sampler stopped early"
    assert proc.poll() is not None, "the sampler outlived the block"
    got = mon.summary()
    assert got["samples"] >= 2 and got["sm_mhz_median"] == 1755.0
    assert got["power_capped_share"] == 1.0 and got["interval_ms"] == 10
    assert got["power_field"] == ("power.draw.instant" if instant else "power.draw")


def test_no_nvidia_smi_gives_none(tmp_path):
    with gpu_clocks.ClockMonitor(smi="no-such-nvidia-smi-here") as mon:
        pass
    assert mon.summary() is None
    broken = tmp_path / "broken-smi"                # a driver that answers no query
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    with gpu_clocks.ClockMonitor(smi=str(broken)) as mon:
        assert mon._proc is None
    assert mon.summary() is None
