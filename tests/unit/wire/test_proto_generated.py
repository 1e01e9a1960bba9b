"""The committed gRPC/protobuf code under diloco/v1/ is exactly what proto/generate.py produces."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "diloco" / "v1"
HINT = "the committed code under diloco/v1/ is stale: run `python proto/generate.py` and commit the result"


def load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_committed(tmp_path):
    generated = load_generator().generate(tmp_path)
    assert generated, "proto/generate.py produced no files"
    names = {p.name for p in generated}
    committed = {p.name for p in COMMITTED.glob("*_pb2*")}
    assert names == committed, f"{HINT} (generated {sorted(names)}, committed {sorted(committed)})"
    stale = [p.name for p in generated if p.read_bytes() != (COMMITTED / p.name).read_bytes()]
    assert not stale, f"{HINT}; differing files: {stale}"


def test_every_proto_is_generated(tmp_path):
    protos = sorted((ROOT / "proto" / "diloco" / "v1").glob("*.proto"))
    assert protos
    generated = {p.name for p in load_generator().generate(tmp_path)}
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert proto.stem + suffix in generated
