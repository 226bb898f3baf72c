"""Summarize an Nsight Compute source page (SASS, CSV) of one kernel: stall reasons, the
share of executed instructions and of warp-stall samples per opcode, and the instructions
with the most samples.

    HOME=$(mktemp -d) ncu --clock-control none -k regex:paged_decode --launch-skip 2 \
        --launch-count 1 --section SourceCounters --section WarpStateStats --page source \
        --print-source sass --csv python3 -m bench.kernel_probe 64 2048 fp8 > sass.csv
    python -m bench.ncu_sass sass.csv            # (or sass.csv.gz)

(The fresh HOME is a guess: on the H200 machine later ncu processes of one call segfaulted at
start-up after a first one had run; a run with a fresh HOME worked, but it was also the first
ncu process of its call. Fifteenth session.)
"""
from __future__ import annotations

import collections
import csv
import gzip
import sys


def _int(x: str) -> int:
    return int(x) if x not in ("", "-") else 0


def summarize(path: str, top: int = 30) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    data = [dict(zip(names, r)) for r in rows[head + 1:] if len(r) == len(names)]
    stalls = [k for k in names if k.startswith("stall_") and "Not Issued" not in k]
    samples = sum(_int(r["# Samples"]) for r in data) or 1
    executed = sum(_int(r["Instructions Executed"]) for r in data) or 1
    out = [f"{len(data)} instructions, {executed} executed (warp level), {samples} samples"]
    by_stall = collections.Counter({k: sum(_int(r[k]) for r in data) for k in stalls})
    out += [f"{k:26s} {v:7d} {v / samples:6.1%}" for k, v in by_stall.most_common(12)]
    ops, op_samples = collections.Counter(), collections.Counter()
    for r in data:
        words = [w for w in r["Source"].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else ""
        ops[op] += _int(r["Instructions Executed"])
        op_samples[op] += _int(r["# Samples"])
    out.append("opcode     executed  samples")
    out += [f"{op:10s} {n / executed:7.1%} {op_samples[op] / samples:7.1%}"
            for op, n in ops.most_common(30)]
    out.append(f"top {top} instructions by samples: address, samples, executed, source, "
               "two largest stall reasons")
    for r in sorted(data, key=lambda r: -_int(r["# Samples"]))[:top]:
        why = sorted(((_int(r[k]), k) for k in stalls), reverse=True)[:2]
        out.append(f'{r["Address"][-5:]} {_int(r["# Samples"]):6d} '
                   f'{_int(r["Instructions Executed"]):8d} {r["Source"].strip()[:56]:56s} {why}')
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    print(summarize(sys.argv[1]))
