"""Which kernels of a compiled program take part in programmatic dependent launch (PDL)?

    XLA_FLAGS=--xla_dump_to=DIR python -m bench.cli decode ...   # any jitted program
    python -m bench.probes.ptx_pdl DIR [--out pdl.json]

Reads the PTX XLA dumped (`*.ptx` under DIR) and, for every kernel entry, whether its body
holds `griddepcontrol.wait` (it may be launched before its predecessor finishes and waits
for it in the kernel) and `griddepcontrol.launch_dependents` (it lets its successor start
before it ends). Kernels are grouped by name with trailing digits dropped (one row per
family: XLA's fusions, its Triton GEMMs, the Pallas kernels by their names). jaxinfer
turns XLA's PDL on (`--xla_gpu_enable_pdl=true`, jaxinfer/__init__.py); whether a kernel
without the wait is launched with the attribute is XLA's choice, not visible here.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+([\w$.]+)", re.M)


def entries(ptx: str):
    """(name, body) per kernel entry of one PTX text."""
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    for i, (at, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        yield name, ptx[at:end]


def family(name: str) -> str:
    return re.sub(r"(_\d+)+$", "", name)


def scan(root: Path) -> list[dict]:
    fams: dict = collections.defaultdict(lambda: collections.Counter())
    for path in sorted(root.rglob("*.ptx")):
        for name, body in entries(path.read_text(errors="replace")):
            c = fams[family(name)]
            c["kernels"] += 1
            c["wait"] += "griddepcontrol.wait" in body
            c["launch_dependents"] += "griddepcontrol.launch_dependents" in body
    return [{"family": f, **dict(c)} for f, c in sorted(fams.items())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", help="directory XLA dumped to (--xla_dump_to)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = scan(Path(args.dump))
    if not rows:
        print(f"no .ptx kernels under {args.dump}", file=sys.stderr)
        return 1
    for r in rows:
        print(f"{r['family'][:60]:60} kernels {r['kernels']:5}  wait {r.get('wait', 0):5}  "
              f"launch_dependents {r.get('launch_dependents', 0):5}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
