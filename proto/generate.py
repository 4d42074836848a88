"""Regenerate the Python code for the .proto files in proto/v1.

The sources are staged under `epd/proto/v1/` in a temporary tree so that protoc writes imports
that resolve inside the installed `epd.proto` package. Run: `python -m epd.proto.generate`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "v1"
OUTPUTS = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto/v1/*.proto into out_dir; returns the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "epd" / "proto" / "v1"
        stage.mkdir(parents=True)
        sources = sorted(PROTO_DIR.glob("*.proto"))
        for src in sources:
            shutil.copy(src, stage / src.name)
        rels = [f"epd/proto/v1/{s.name}" for s in sources]
        args = ["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *rels]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in sorted(stage.iterdir()):
            if f.name.endswith(OUTPUTS):
                shutil.copy(f, out_dir / f.name)
                written.append(out_dir / f.name)
        return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
