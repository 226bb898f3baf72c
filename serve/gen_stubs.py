"""Regenerate the gRPC stubs from serve/jaxinfer.proto (the generated files are committed;
nobody edits them by hand):

    python serve/gen_stubs.py           # writes serve/jaxinfer_pb2.py, .pyi, _pb2_grpc.py
    python serve/gen_stubs.py --check   # exit 1 if the committed files differ from a fresh run

The generator version is pinned because generated code refuses any runtime older than its
generator: stubs from grpcio-tools 1.75.1 need grpcio >= 1.75.1 and protobuf >= 6.31.1, which
every supported runtime has (the H200 image ships grpcio 1.84); stubs from a newer
grpcio-tools would not import there. To regenerate with a different grpcio-tools installed:
    python -m venv /tmp/gen && /tmp/gen/bin/pip install grpcio-tools==1.75.1
    /tmp/gen/bin/python serve/gen_stubs.py

`-I <repo root>` with the proto at serve/jaxinfer.proto makes the grpc module import
`serve.jaxinfer_pb2`, so no post-processing is needed.
"""
from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

GRPCIO_TOOLS_VERSION = "1.75.1"
ROOT = Path(__file__).resolve().parent.parent
PROTO = "serve/jaxinfer.proto"
GENERATED = ("serve/jaxinfer_pb2.py", "serve/jaxinfer_pb2.pyi", "serve/jaxinfer_pb2_grpc.py")


def installed_tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def generate(out_dir: Path, python: str = sys.executable) -> None:
    """Run protoc (from grpcio-tools under `python`) over the proto into out_dir/serve/."""
    (out_dir / "serve").mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}",
                    f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(ROOT / PROTO)],
                   check=True)


def differing(out_dir: Path) -> list[str]:
    """Generated files under out_dir that differ from the committed ones."""
    return [f for f in GENERATED if not (ROOT / f).is_file()
            or not filecmp.cmp(out_dir / f, ROOT / f, shallow=False)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="compare a fresh generation with the committed files; write nothing")
    args = p.parse_args(argv)
    have = installed_tools_version()
    if have != GRPCIO_TOOLS_VERSION:
        print(f"gen_stubs: grpcio-tools {have} is installed; the stubs are pinned to "
              f"{GRPCIO_TOOLS_VERSION} (see this file's docstring)", file=sys.stderr)
        return 2
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            bad = differing(Path(tmp))
        for f in bad:
            print(f"gen_stubs: {f} differs from a fresh generation", file=sys.stderr)
        return 1 if bad else 0
    generate(ROOT)
    print("wrote " + ", ".join(GENERATED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
