"""One-off device probes (bench/README.md lists them) and the result file they share."""
from __future__ import annotations

import datetime
import json
import sys

import jax

from bench.common import git_sha
from bench.profile import device_seconds


def write_probe(path: str, probe: str, git: str | None, argv, rows: list[dict],
                **extra) -> None:
    """A probe's result file: its name, device, jax, git (`--git` or HEAD), date, the command
    that ran it (argv: main's, None for the process's), `extra` keys, then its rows."""
    args = sys.argv[1:] if argv is None else argv
    with open(path, "w") as f:
        json.dump({"probe": probe, "device": jax.devices()[0].device_kind,
                   "jax": jax.__version__, "git": git_sha(git),
                   "date": datetime.date.today().isoformat(),
                   "command": " ".join([f"python -m bench.probes.{probe}", *args]),
                   **extra, "rows": rows}, f, indent=1)


def interleaved_us(runs: dict, rounds: int) -> dict[str, list[float]]:
    """runs: name -> (run, calls), run() dispatching `calls` calls and returning their
    outputs. Device us per call of each (bench.profile.device_seconds), the names taken in
    turn within each of `rounds` rounds, so drifts of the machine touch them alike; the
    lists stay empty off the GPU."""
    samples = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (run, calls) in runs.items():
            sec = device_seconds(run, calls)
            if sec is not None:
                samples[name].append(sec * 1e6)
    return samples
