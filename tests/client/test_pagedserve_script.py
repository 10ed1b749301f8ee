"""The `pagedserve` console script, as installed: every command explains itself, the service commands pass
their arguments through, and `pagedserve serve --simulated` answers a generation and stops cleanly on a
signal, leaving no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from client.cli import COMMANDS
from client.local import loopback, wait_until
from client.port_file import wait_ports
from client.serve import READY_LINE
from tests.support.procs import ROOT, free_port, stop, wait_healthy

SCRIPT = Path(sys.executable).parent / "pagedserve"
TIMEOUT_S = 300.0  # the test machine's two cores are shared with other suites: start-up can be slow


@pytest.fixture(scope="module")
def script() -> Path:
    if not SCRIPT.exists():
        pytest.fail(f"{SCRIPT} is not installed: `{sys.executable} -m pip install -e .` (scripts/setup.sh does it "
                    "when pyproject.toml changes)")
    return SCRIPT


def pagedserve(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)


def test_help_lists_every_command(script: Path) -> None:
    out = pagedserve(script, "--help")
    assert out.returncode == 0, out.stderr
    for name in ("serve", "scheduler", "executor", "frontend", "generate", "bench", "health"):
        assert f"\n    {name}" in out.stdout
    assert set(COMMANDS) == {"serve", "scheduler", "executor", "frontend", "generate", "bench", "health"}


def test_no_command_or_an_unknown_one_is_a_usage_error(script: Path) -> None:
    none = pagedserve(script)
    assert none.returncode == 2 and "COMMAND" in none.stderr
    unknown = pagedserve(script, "srve")
    assert unknown.returncode == 2 and "invalid choice: 'srve'" in unknown.stderr
    version = pagedserve(script, "--version")
    assert version.returncode == 0 and version.stdout.startswith("pagedserve ")


# A flag each command's own parser has, so the help shown is that command's, not the top level's.
OWN_FLAG = {"serve": "--simulated", "scheduler": "--api-server-count", "executor": "--tensor-parallel-size",
            "frontend": "--engine-core",
            "generate": "--max-tokens", "bench": "--request-rate", "health": "--service"}


@pytest.mark.parametrize("name", sorted(OWN_FLAG))
def test_every_command_has_help(script: Path, name: str) -> None:
    out = pagedserve(script, name, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:") and OWN_FLAG[name] in out.stdout


def test_scheduler_help_is_the_scheduler_services_named_after_the_script(script: Path) -> None:
    out = pagedserve(script, "scheduler", "--help")
    direct = subprocess.run([sys.executable, "-m", "scheduler_service", "--help"], capture_output=True, text=True,
                            timeout=TIMEOUT_S, cwd=ROOT)
    assert out.returncode == direct.returncode == 0
    assert out.stdout.startswith("usage: pagedserve scheduler"), out.stdout[:200]
    assert direct.stdout.startswith("usage: python -m scheduler_service")
    assert out.stdout.split("\n\n", 1)[1] == direct.stdout.split("\n\n", 1)[1], "the same flags after the usage"
    for flag in ("--listen", "--executor", "--metrics-port", "--http-listen", "--policy", "--shutdown-timeout"):
        assert flag in out.stdout


def test_frontend_is_the_frontend_process_named_after_the_script(script: Path) -> None:
    out = pagedserve(script, "frontend", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: pagedserve frontend"), out.stdout[:200]
    direct = subprocess.run([sys.executable, "-m", "scheduler_service.frontend", "--help"], capture_output=True,
                            text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert direct.returncode == 0 and direct.stdout.startswith("usage: python -m scheduler_service.frontend")
    assert out.stdout.split("\n\n", 1)[1] == direct.stdout.split("\n\n", 1)[1], "the same flags after the usage"
    missing = pagedserve(script, "frontend", "--listen", "127.0.0.1:0")
    assert missing.returncode != 0 and "--engine-core is required" in missing.stderr, missing.stderr


def test_service_commands_pass_arguments_through(script: Path) -> None:
    for name in ("scheduler", "executor", "frontend"):
        out = pagedserve(script, name, "--no-such-flag")
        assert out.returncode == 2 and "unrecognized arguments: --no-such-flag" in out.stderr, out.stderr


def test_client_commands_are_named_after_the_script(script: Path) -> None:
    out = pagedserve(script, "generate", "--help")
    assert out.stdout.startswith("usage: pagedserve generate")
    direct = subprocess.run([sys.executable, "-m", "client", "generate", "--help"], capture_output=True, text=True,
                            timeout=TIMEOUT_S, cwd=ROOT)
    assert direct.returncode == 0 and direct.stdout.startswith("usage: python -m client generate")


def test_importing_the_script_module_is_light() -> None:
    code = ("import sys, client.cli; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'numpy', 'grpc', 'scheduler_service', 'executor_service', 'protos'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_rejects_a_model_with_simulated(script: Path) -> None:
    out = pagedserve(script, "serve", "--simulated", "some/model")
    assert out.returncode == 2 and "--simulated" in out.stderr


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_service_commands_serve(script: Path, tmp_path: Path) -> None:
    """`pagedserve executor` and `pagedserve scheduler` as the two processes of a stack (the scheduler's api
    server processes are spawned from the console script, not from `python -m`)."""
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("executor", "scheduler")}  # noqa: SIM115
    executor = subprocess.Popen([str(script), "executor", "--listen", "127.0.0.1:0", "--port-file", "executor.ports",
                                 "--simulated"], cwd=tmp_path, stdout=logs["executor"], stderr=subprocess.STDOUT)
    scheduler = None
    try:
        ex_addr = loopback(wait_ports(tmp_path / "executor.ports", ("listen",), executor)["listen"])
        scheduler = subprocess.Popen([str(script), "scheduler", "--listen", "127.0.0.1:0", "--port-file",
                                      "scheduler.ports", "--executor", ex_addr, "--api-server-count", "1",
                                      "--metrics-port", "-1"], cwd=tmp_path, stdout=logs["scheduler"],
                                     stderr=subprocess.STDOUT)
        sc_addr = loopback(wait_ports(tmp_path / "scheduler.ports", ("listen",), scheduler)["listen"])
        wait_healthy(sc_addr, executor, scheduler, timeout=TIMEOUT_S)
        gen = pagedserve(script, "generate", "--server", sc_addr, "--max-tokens", "4", "--timeout", "120", "--json",
                         "Hi")
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stdout.splitlines()[-1])["usage"]["completion_tokens"] == 4
        assert pagedserve(script, "health", "--server", ex_addr).stdout.strip() == "SERVING"
        assert stop(scheduler) == 0 and stop(executor) == 0
    except BaseException:
        for name in logs:
            sys.stderr.write(f"--- {name} ---\n{(tmp_path / f'{name}.log').read_text(errors='replace')}\n")
        raise
    finally:
        if scheduler is not None:
            stop(scheduler)
        stop(executor)
        for f in logs.values():
            f.close()


# ---------------------------------------------------------------------------------------------------------------
# pagedserve serve --simulated, end to end


@dataclass
class Output:
    """The serve process's stdout and stderr, read line by line on a thread; `eof` is set once every process
    that inherited the pipe (the services and their children included) has closed it, i.e. exited."""
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)
    eof: threading.Event = field(default_factory=threading.Event)

    def read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.eof.set()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} line after {timeout}s:\n{self.text()}") from None
            self.seen.append(line)
            if text in line:
                return

    def text(self) -> str:
        while not self.lines.empty():
            self.seen.append(self.lines.get_nowait())
        return "".join(self.seen)


def session_processes(sid: int) -> dict[int, str]:
    """Live processes (pid -> state) in session sid; zombies are dead, only waiting to be reaped."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry.name)] = fields[0]
    return found


@contextlib.contextmanager
def serving(script: Path, cwd: Path) -> Iterator[tuple[subprocess.Popen[str], Output, str]]:
    """`pagedserve serve --simulated` on free ports, in a session of its own (so that every process it starts
    can be found by session id); whatever is left is killed afterwards."""
    address = f"127.0.0.1:{free_port()}"
    command = [str(script), "serve", "--simulated", "--listen", address,
               "--http-listen", f"127.0.0.1:{free_port()}", "--executor-listen", f"127.0.0.1:{free_port()}",
               "--metrics-port", str(free_port())]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    output = Output()
    threading.Thread(target=output.read, args=(proc.stdout,), daemon=True).start()
    try:
        yield proc, output, address
    finally:
        for pid in session_processes(proc.pid):  # only after a failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S)


@pytest.mark.timeout(3 * TIMEOUT_S)  # its own waits fail first, with serve's output
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_serve_simulated_answers_and_stops_cleanly(script: Path, tmp_path: Path, how: str) -> None:
    with serving(script, tmp_path) as (proc, output, address):
        output.wait_for(READY_LINE, TIMEOUT_S)
        assert "demo: 'Once upon a time, there was'" in output.text()
        gen = pagedserve(script, "generate", "--server", address, "--max-tokens", "8", "--temperature", "0",
                         "--timeout", "120", "--json", "Hello")
        assert gen.returncode == 0, gen.stderr
        last = json.loads(gen.stdout.splitlines()[-1])
        assert last["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 8

        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground process group
        elif how == "sigterm":
            proc.send_signal(signal.SIGTERM)  # `kill PID`: serve alone, which stops the services
        else:
            proc.kill()  # serve cannot stop them: the kernel sends the services SIGTERM (PR_SET_PDEATHSIG)
        returncode = proc.wait(timeout=TIMEOUT_S)
        assert output.eof.wait(TIMEOUT_S), f"a process still holds serve's output:\n{output.text()}"
        # (a process closes its output while it exits, before it is gone: on a loaded machine it can still be seen)
        wait_until(lambda: session_processes(proc.pid) == {}, TIMEOUT_S, "the session's processes to exit")
        log = output.text()
        assert returncode == (-signal.SIGKILL if how == "sigkill" else 0), log
        # Both services stopped their own way, not killed.
        assert "api servers stopped" in log and "executor stopped" in log, log
        assert "did not stop" not in log
