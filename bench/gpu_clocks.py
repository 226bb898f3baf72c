"""The GPU's SM clock and board power while a benchmark runs, for its result row.

Under sustained load an H200 can sit at its power cap with the SM clock well under its peak,
so runs of different lengths or machines can differ by their clocks as much as by the code;
a row that carries its clocks says which it had.

    with ClockMonitor() as mon:
        ...                                   # the measured work
    row["gpu_clocks"] = mon.summary()         # None without nvidia-smi (the CPU)

nvidia-smi runs in a background process, sampling every `interval_ms`; only samples with the
GPU busy (utilization > 0) count.
"""
from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import tempfile

# power.draw.instant where the driver has it: plain power.draw is an average over about a
# second on recent drivers, which lags a burst's start
QUERIES = ("clocks.sm,power.draw.instant,utilization.gpu,clocks_event_reasons.active",
           "clocks.sm,power.draw,utilization.gpu,clocks_event_reasons.active")
# NVML's clock-event reason bits (nvmlClocksEventReasons)
SW_POWER_CAP = 0x4
SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80    # HW slowdown, SW / HW thermal, HW power brake


def parse(lines) -> list[tuple[float, float | None, float, int]]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines of a QUERIES entry -> (SM MHz,
    watts or None, utilization %, reason bits); lines that do not parse (its error messages)
    are skipped."""
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
    """The busy samples' clock and power: SM MHz (median, 10th percentile, min, max), watts
    (median, 90th percentile, max), and the shares of samples held back by the power cap and
    by other slowdowns. A run that mixes light and heavy phases (the decode harness's synced
    steps and its bursts) has a low median and a high 90th percentile. None when no sample
    had the GPU busy."""
    busy = [s for s in samples if s[2] > 0]
    if not busy:
        return None
    mhz = sorted(s[0] for s in busy)
    watts = sorted(s[1] for s in busy if s[1] is not None)
    share = lambda bits: round(sum(bool(s[3] & bits) for s in busy) / len(busy), 3)  # noqa: E731
    at = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]                       # noqa: E731
    return {"samples": len(busy), "interval_ms": interval_ms,
            "sm_mhz_median": statistics.median(mhz), "sm_mhz_p10": at(mhz, 0.1),
            "sm_mhz_min": mhz[0], "sm_mhz_max": mhz[-1],
            "power_w_median": round(statistics.median(watts), 1) if watts else None,
            "power_w_p90": round(at(watts, 0.9), 1) if watts else None,
            "power_w_max": round(watts[-1], 1) if watts else None,
            "power_capped_share": share(SW_POWER_CAP), "slowdown_share": share(SLOWDOWN)}


@functools.lru_cache(maxsize=None)
def _query(smi: str, gpu: str) -> str | None:
    """The first QUERIES entry whose one sample parses (older drivers reject newer field
    names), or None; asked once per process (the decode harness opens a monitor per case)."""
    for query in QUERIES:
        try:
            out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                  "-i", gpu], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and parse(out.stdout.splitlines()):
            return query
    return None


class ClockMonitor:
    """A context manager sampling the first visible GPU (module docstring)."""

    def __init__(self, interval_ms: int = 50, smi: str = "nvidia-smi"):
        self.interval_ms, self._smi = interval_ms, shutil.which(smi)
        self._proc = self._out = None
        self._lines: list[str] = []
        self.power_field: str | None = None     # the QUERIES entry's power field in use

    def __enter__(self) -> "ClockMonitor":
        if self._smi is None:
            return self
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        query = _query(self._smi, gpu)
        if query is None:            # a driver that knows neither: no samples, summary None
            return self
        self.power_field = query.split(",")[1]
        self._out = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(
            [self._smi, f"--query-gpu={query}", "--format=csv,noheader,nounits",
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
        """summarize() of the samples taken and the power field read (None without
        nvidia-smi or busy samples)."""
        got = summarize(parse(self._lines), self.interval_ms)
        return None if got is None else dict(got, power_field=self.power_field)
