"""The generated protobuf/gRPC code committed in proto/v1 matches what protoc makes of the
.proto files today (no drift), and imports as the epd.proto.v1 package."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from epd.proto import generate


def test_generated_code_has_no_drift(tmp_path: Path):
    written = generate.generate(tmp_path)
    names = sorted(p.name for p in written)
    committed = sorted(p.name for p in generate.PROTO_DIR.iterdir()
                       if p.name.endswith(generate.OUTPUTS))
    assert names == committed and names, (names, committed)
    for p in written:
        want = (generate.PROTO_DIR / p.name).read_bytes()
        assert p.read_bytes() == want, f"{p.name} differs: run python -m epd.proto.generate"


def test_generated_modules_import():
    from epd.proto.v1 import epd_pb2, epd_pb2_grpc
    assert epd_pb2.DESCRIPTOR.package == "epd.v1"
    assert {s.name for s in epd_pb2.DESCRIPTOR.services_by_name.values()} == {"Node", "Engine",
                                                                         "Cluster"}
    assert hasattr(epd_pb2_grpc, "EngineStub") and hasattr(epd_pb2_grpc, "NodeStub")


def test_drift_is_detected(tmp_path: Path):
    """The check above can fail: an edited .proto gives different code."""
    src = next(generate.PROTO_DIR.glob("*.proto"))
    text = src.read_text()
    assert "message TensorDesc {" in text
    out = tmp_path / "out"
    orig = generate.PROTO_DIR
    stage = tmp_path / "v1"
    stage.mkdir()
    (stage / src.name).write_text(text.replace("message TensorDesc {",
                                               "message TensorDesc {\n  int32 extra = 99;", 1))
    try:
        generate.PROTO_DIR = stage
        written = generate.generate(out)
    finally:
        generate.PROTO_DIR = orig
    pb2 = next(p for p in written if p.name.endswith("_pb2.py"))
    assert pb2.read_bytes() != (orig / pb2.name).read_bytes()
