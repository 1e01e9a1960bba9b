"""Regenerate diloco/v1/*_pb2*.py from proto/diloco/v1/*.proto (grpcio-tools).

python proto/generate.py            # into the repository
python proto/generate.py --out DIR  # elsewhere (the test compares the two)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    protos = sorted(PROTO_DIR.glob("diloco/v1/*.proto"))
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if protoc.main([*args, *map(str, protos)]) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "diloco" / "v1").glob("*_pb2*"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT)
    for path in generate(parser.parse_args().out):
        print(path, file=sys.stderr)
