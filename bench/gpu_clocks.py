"""The GPU's SM clock and board power while a benchmark runs, for its result row.

Under sustained load the H200 runs at its 700 W power cap: in the nineteenth session's
8B FP8 decode harness at 384 rows the SM clock ran mostly at 1.7-1.8 GHz instead of 1.98
(nvidia-smi's clock-event reason "software power cap"), while a profiler's short bursts ran
at ~1.95 GHz (bench/README.md). Runs on other machines, or of other lengths, can differ by
their clocks as much as by the code; a row that carries its clocks says which it had.

    with ClockMonitor() as mon:
        ...                                   # the measured work
    row["gpu_clocks"] = mon.summary()         # None without nvidia-smi (the CPU)

nvidia-smi runs in a background process, sampling every `interval_ms`; only samples with the
GPU busy (utilization > 0) count.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile

QUERY = "clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active"
# NVML's clock-event reason bits (nvmlClocksEventReasons)
SW_POWER_CAP = 0x4
SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80    # HW slowdown, SW / HW thermal, HW power brake


def parse(lines) -> list[tuple[float, float | None, float, int]]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines of QUERY -> (SM MHz, watts or None,
    utilization %, reason bits); lines that do not parse (its error messages) are skipped."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            mhz, util, reasons = float(parts[0]), float(parts[2]), int(parts[3], 16)
        except ValueError:
            continue
        try:
            watts = float(parts[1])
        except ValueError:       # "[N/A]" on boards without a power sensor
            watts = None
        samples.append((mhz, watts, util, reasons))
    return samples


def summarize(samples, interval_ms: int) -> dict | None:
    """The busy samples' clock and power: median, min and max SM MHz, median and max watts,
    and the shares of samples held back by the power cap and by other slowdowns. None when
    no sample had the GPU busy."""
    busy = [s for s in samples if s[2] > 0]
    if not busy:
        return None
    mhz = [s[0] for s in busy]
    watts = [s[1] for s in busy if s[1] is not None]
    share = lambda bits: round(sum(bool(s[3] & bits) for s in busy) / len(busy), 3)  # noqa: E731
    return {"samples": len(busy), "interval_ms": interval_ms,
            "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "sm_mhz_max": max(mhz),
            "power_w_median": round(statistics.median(watts), 1) if watts else None,
            "power_w_max": round(max(watts), 1) if watts else None,
            "power_capped_share": share(SW_POWER_CAP), "slowdown_share": share(SLOWDOWN)}


class ClockMonitor:
    """A context manager sampling the first visible GPU (module docstring)."""

    def __init__(self, interval_ms: int = 50, smi: str = "nvidia-smi"):
        self.interval_ms, self._smi = interval_ms, shutil.which(smi)
        self._proc = self._out = None
        self._lines: list[str] = []

    def __enter__(self) -> "ClockMonitor":
        if self._smi is None:
            return self
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        self._out = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [self._smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             "-i", gpu, "-lms", str(self.interval_ms)],
            stdout=self._out, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.seek(0)
        self._lines = self._out.read().splitlines()
        self._out.close()
        self._proc = None

    def summary(self) -> dict | None:
        """summarize() of the samples taken (None without nvidia-smi or busy samples)."""
        return summarize(parse(self._lines), self.interval_ms)
