"""Start-up errors of the executor process are one clear line and a non-zero exit, not a stack trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT


def run_executor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "executor_service", "--listen", "127.0.0.1:0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("setup,expected", [
    (lambda d: None, "missing file config.json"),
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})),
     "unsupported architecture (GPT2LMHeadModel)"),
])
def test_bad_model_directory_fails_at_start_with_a_clear_message(tmp_path: Path, setup: object,
                                                                  expected: str) -> None:
    setup(tmp_path)  # type: ignore[operator]
    proc = run_executor("--model", str(tmp_path))
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
