"""The generated Python beside the .proto files must match what the sources generate now."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos" / "pagedserve" / "v1"


def test_generated_code_is_current(tmp_path: Path) -> None:
    target = tmp_path / "protos" / "pagedserve" / "v1"
    target.mkdir(parents=True)
    for proto in PROTO_DIR.glob("*.proto"):
        shutil.copy(proto, target / proto.name)
    protos = sorted(str(p.relative_to(tmp_path)) for p in target.glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", *protos], cwd=tmp_path, check=True)
    generated = sorted(p.name for p in target.iterdir() if p.suffix in {".py", ".pyi"})
    checked_in = sorted(p.name for p in PROTO_DIR.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi",
                                                                              "_pb2_grpc.py")))
    assert generated == checked_in
    stale = [n for n in generated if (target / n).read_bytes() != (PROTO_DIR / n).read_bytes()]
    assert not stale, f"run protos/generate.sh: stale generated files {stale}"


def test_generated_modules_import_package_qualified() -> None:
    text = (PROTO_DIR / "generation_pb2_grpc.py").read_text()
    assert "from protos.pagedserve.v1 import generation_pb2" in text


def test_enum_zero_values_are_prefixed() -> None:
    from protos.pagedserve.v1 import generation_pb2

    assert generation_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
