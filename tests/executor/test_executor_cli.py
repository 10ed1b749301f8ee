"""Start-up errors of the executor process are one clear line and a non-zero exit, not a stack trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT


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


def test_ctrl_c_stops_the_executor_with_one_clean_line(tmp_path: Path) -> None:
    import signal

    from executor_service.default_model.model import make_model
    from tests.support.procs import loopback, start_listening, wait_healthy

    path = make_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=64)
    log = tmp_path / "executor.log"
    proc, ports = start_listening("executor_service", ["--model", str(path), "--device", "cpu"], log)
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        ready_lines = len(log.read_text().splitlines())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    after = log.read_text().splitlines()[ready_lines:]
    # The packing after ready and the deferred torch imports (2 s after ready) may log their own INFO lines before
    # or after the signal lands; Ctrl-C adds only the stop line, and nothing from the stop is a warning, an error
    # or a traceback.
    stop_lines = [line for line in after if "packed" not in line and "deferred torch imports run" not in line]
    assert len(stop_lines) == 1 and stop_lines[0].endswith("executor stopped"), after
    assert all(" INFO " in line for line in after), after
