"""bench/gpu_clocks.py: nvidia-smi's samples parsed and summarized, the sampler process run
and stopped around a block (a stand-in script for nvidia-smi), and no nvidia-smi (the CPU)
giving None."""
import os
import stat
import time

from bench import gpu_clocks

# the nineteenth session's H200 samples, as --format=csv,noheader,nounits writes them
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
                   "sm_mhz_min": 1470.0, "sm_mhz_max": 1965.0, "power_w_median": 689.6,
                   "power_w_max": 690.4, "power_capped_share": 0.5, "slowdown_share": 0.25}
    assert gpu_clocks.summarize(gpu_clocks.parse(LINES[:1] + LINES[-1:]), 50) is None


def test_monitor_runs_and_stops_the_sampler(tmp_path):
    smi = tmp_path / "fake-smi"
    smi.write_text("#!/bin/sh\n"
                   "while true; do echo '1755, 690.39, 100, 0x0000000000000004'; sleep 0.01;"
                   " done\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    with gpu_clocks.ClockMonitor(interval_ms=10, smi=str(smi)) as mon:
        proc = mon._proc
        deadline = time.monotonic() + 10
        while os.fstat(mon._out.fileno()).st_size < 100 and time.monotonic() < deadline:
            time.sleep(0.01)                        # until a few samples are written
        assert proc.poll() is None, "the sampler stopped early"
    assert proc.poll() is not None, "the sampler outlived the block"
    got = mon.summary()
    assert got["samples"] >= 2 and got["sm_mhz_median"] == 1755.0
    assert got["power_capped_share"] == 1.0 and got["interval_ms"] == 10


def test_no_nvidia_smi_gives_none():
    with gpu_clocks.ClockMonitor(smi="no-such-nvidia-smi-here") as mon:
        pass
    assert mon.summary() is None
