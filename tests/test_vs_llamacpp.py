"""benchmarks/vs_llamacpp.py skips cleanly where no llama-server can be had (#29): one JSON line saying why, exit 0,
no model made and nothing started."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import vs_llamacpp


def test_it_skips_with_a_reason_when_there_is_no_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PAGEDSERVE_LLAMACPP_DIR", str(tmp_path / "llama.cpp"))  # no cached build there
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None)  # no llama-server on PATH either
    vs_llamacpp.main(["--no-build", "--model-dir", str(tmp_path / "model")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "vs_llamacpp" and "no llama-server" in out["skipped"]
    assert not (tmp_path / "model").exists()
