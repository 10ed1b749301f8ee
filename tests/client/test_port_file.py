"""--port-file: the writer's whole-file rewrites and the reader's wait."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.port_file import PortFile, read_ports, wait_ports


def test_each_port_recorded_is_in_the_file_with_those_before_it(tmp_path: Path) -> None:
    path = tmp_path / "ports"
    ports = PortFile(str(path))
    assert read_ports(path) == {}
    ports.record("listen", 41234)
    assert read_ports(path) == {"listen": 41234}
    ports.record("metrics_port", 41235)
    assert read_ports(path) == {"listen": 41234, "metrics_port": 41235}
    assert [p.name for p in tmp_path.iterdir()] == ["ports"], "no partial file is left beside it"


def test_without_a_path_nothing_is_written(tmp_path: Path) -> None:
    PortFile(None).record("listen", 1)
    assert list(tmp_path.iterdir()) == []


def test_the_wait_ends_when_the_process_exits_first(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with 3 before writing listen"):
        wait_ports(tmp_path / "ports", ("listen",), proc)


def test_the_wait_returns_once_every_name_is_there(tmp_path: Path) -> None:
    PortFile(str(tmp_path / "ports")).record("listen", 7)
    assert wait_ports(tmp_path / "ports", ("listen",), timeout=0.0) == {"listen": 7}
    with pytest.raises(TimeoutError, match="has no metrics_port"):
        wait_ports(tmp_path / "ports", ("listen", "metrics_port"), timeout=0.0)


def test_a_failed_write_leaves_no_partial_file(tmp_path: Path) -> None:
    (tmp_path / "ports").mkdir()
    with pytest.raises(IsADirectoryError):
        PortFile(str(tmp_path / "ports")).record("listen", 7)
    assert [p.name for p in tmp_path.iterdir()] == ["ports"]


@pytest.mark.parametrize(("module", "port_file", "problem"), [
    (m, name, problem) for m in ("executor_service", "scheduler_service") for name, problem in (
        ("missing/ports.json", "its directory {tmp}/missing does not exist"), (".", "is a directory"))])
def test_a_port_file_that_cannot_be_written_stops_the_start_with_one_line(tmp_path: Path, module: str,
                                                                          port_file: str, problem: str) -> None:
    """Checked before any port is bound: a traceback after the first bind before (and a directory left a
    `.partial` file beside it)."""
    path = str(tmp_path / port_file) if port_file != "." else str(tmp_path)
    args = ["--simulated"] if module == "executor_service" else []
    done = subprocess.run([sys.executable, "-m", module, *args, "--listen", "127.0.0.1:0", "--port-file", path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == f"--port-file {path}: {problem.format(tmp=tmp_path)}"
    assert not [p for p in tmp_path.parent.iterdir() if p.name.endswith(".partial")]


def test_a_link_planted_where_the_partial_file_was_written_is_not_written_through(tmp_path: Path) -> None:
    """The partial file had a predictable name (the path, the pid): a link planted there in a shared directory
    such as /tmp had the service write its ports into whatever file the link named."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "ports"
    (tmp_path / f"ports.{os.getpid()}.partial").symlink_to(victim)
    PortFile(str(path)).record("listen", 7)
    assert victim.read_text() == "precious" and read_ports(path) == {"listen": 7}
    assert os.stat(path).st_mode & 0o777 == 0o644
