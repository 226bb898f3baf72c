"""One-off device probes (bench/README.md lists them) and the result file they share."""
from __future__ import annotations

import datetime
import json
import sys

import jax

from bench.common import git_sha


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
