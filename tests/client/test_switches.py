"""client/switches.py: one parse of an on/off environment variable, and every place that reads one.

Each reader is checked with spellings the old per-site parsers disagreed on (PAGEDSERVE_CONVERTED_CACHE took only
"0" as off; "off" or "false" left the cache on) and with a bad value, which must be an error naming the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.switches import OFF, ON, SwitchError, env_switch, parse_switch
from executor_service import prefetch
from executor_service.__main__ import deferral_for
from executor_service.config import CONVERTED_CACHE_ENV, LAZY_TORCH_IMPORT_ENV, ExecutorConfig, apply_switches

ROOT = Path(__file__).resolve().parents[2]
OFF_SPELLINGS = ["0", "false", "False", "NO", " off ", "Off\n"]
ON_SPELLINGS = ["1", "true", "TRUE", "yes", "On", " 1 "]


@pytest.mark.parametrize("text", ON_SPELLINGS)
def test_every_on_spelling_is_on_whatever_the_default(text: str) -> None:
    assert parse_switch("X", text, default=False) is True
    assert parse_switch("X", text, default=True) is True


@pytest.mark.parametrize("text", OFF_SPELLINGS)
def test_every_off_spelling_is_off_whatever_the_default(text: str) -> None:
    assert parse_switch("X", text, default=True) is False
    assert parse_switch("X", text, default=False) is False


@pytest.mark.parametrize("text", [None, "", "  "])
def test_unset_or_empty_is_the_default(text: str | None) -> None:
    assert parse_switch("X", text, default=True) is True
    assert parse_switch("X", text, default=False) is False


@pytest.mark.parametrize("text", ["maybe", "flase", "2", "-1", "disabled", "y"])
def test_an_unknown_value_is_an_error_naming_the_variable_and_the_spellings(text: str) -> None:
    with pytest.raises(SwitchError) as caught:
        parse_switch("PAGEDSERVE_SOMETHING", text, default=True)
    message = str(caught.value)
    assert f"PAGEDSERVE_SOMETHING={text!r}" in message
    assert all(spelling in message for spelling in ON + OFF)


def test_env_switch_reads_the_given_mapping_or_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_switch("PAGEDSERVE_X", True, {"PAGEDSERVE_X": "no"}) is False
    monkeypatch.setenv("PAGEDSERVE_X", "off")
    assert env_switch("PAGEDSERVE_X", True) is False
    monkeypatch.delenv("PAGEDSERVE_X")
    assert env_switch("PAGEDSERVE_X", True) is True


# ------------------------------------------------------------------------------------ the executor's switches
@pytest.mark.parametrize("text", OFF_SPELLINGS)
def test_each_off_spelling_turns_the_converted_weights_cache_off(text: str, tmp_path: Path) -> None:
    config = apply_switches(ExecutorConfig(model="m", startup_cache_dir=str(tmp_path)), {CONVERTED_CACHE_ENV: text})
    assert not config.converted_weights_cache and config.lazy_torch_import
    assert prefetch.cache_for(config) is None


@pytest.mark.parametrize("text", OFF_SPELLINGS)
def test_each_off_spelling_turns_the_lazy_torch_import_off(text: str) -> None:
    config = apply_switches(ExecutorConfig(simulated=False), {LAZY_TORCH_IMPORT_ENV: text})
    assert not config.lazy_torch_import and config.converted_weights_cache
    assert deferral_for(config) is None


@pytest.mark.parametrize("name", [CONVERTED_CACHE_ENV, LAZY_TORCH_IMPORT_ENV])
def test_a_switch_set_on_leaves_its_flag_as_given(name: str) -> None:
    on = apply_switches(ExecutorConfig(), {name: "yes"})
    assert on.converted_weights_cache and on.lazy_torch_import
    flags_off = ExecutorConfig(converted_weights_cache=False, lazy_torch_import=False)
    assert apply_switches(flags_off, {name: "on"}) == flags_off


@pytest.mark.parametrize("name", [CONVERTED_CACHE_ENV, LAZY_TORCH_IMPORT_ENV])
def test_the_flags_read_the_environment_and_refuse_a_bad_value(name: str, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(name, "FALSE")
    config = ExecutorConfig.from_args(["--simulated"])
    assert not (config.converted_weights_cache if name == CONVERTED_CACHE_ENV else config.lazy_torch_import)
    monkeypatch.setenv(name, "nope")
    with pytest.raises(SystemExit) as caught:
        ExecutorConfig.from_args(["--simulated"])
    assert caught.value.code == 2
    assert f"{name}='nope' is not a switch value" in capsys.readouterr().err


def test_the_executor_refuses_to_start_on_a_bad_switch_with_one_line_naming_it() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PAGEDSERVE_CONVERTED_CACHE="disabled")
    done = subprocess.run([sys.executable, "-m", "executor_service", "--simulated", "--listen", "127.0.0.1:0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "PAGEDSERVE_CONVERTED_CACHE='disabled' is not a switch value" in done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------- the benchmarks' re-execution markers
@pytest.mark.parametrize("module", ["benchmarks.skinny_stream", "benchmarks.forward_steps"])
@pytest.mark.parametrize("marker, reexecs", [("1", False), ("yes", False), ("0", True), ("off", True)])
def test_a_benchmarks_reexec_marker_reads_as_a_switch(module: str, marker: str, reexecs: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker a benchmark sets before re-executing itself under the executor's OpenMP settings: set on, it
    does not re-execute again; set off (before: any non-empty text counted as set), it does."""
    bench = pytest.importorskip(module)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(bench.REEXEC_ENV, marker)
    calls: list[str] = []
    monkeypatch.setattr(bench.os, "execve", lambda path, args, env: calls.append(env[bench.REEXEC_ENV]))
    if module.endswith("skinny_stream"):
        bench.apply_executor_omp()
    else:
        bench.apply_wait_policy("auto", -1)
    assert calls == (["1"] if reexecs else [])


# ------------------------------------------------------------------------------------------- the scripts' switches
COMPOSE_CHECK = ROOT / "scripts" / "compose_check.sh"


def keep_logs(value: str | None) -> subprocess.CompletedProcess[str]:
    """compose_check.sh's own line that reads COMPOSE_CHECK_KEEP_LOGS, run by bash as the script runs it."""
    lines = [line for line in COMPOSE_CHECK.read_text().splitlines() if line.startswith("KEEP_LOGS=")]
    assert len(lines) == 1, "compose_check.sh reads COMPOSE_CHECK_KEEP_LOGS once, into KEEP_LOGS"
    env = {k: v for k, v in os.environ.items() if k != "COMPOSE_CHECK_KEEP_LOGS"}
    if value is not None:
        env["COMPOSE_CHECK_KEEP_LOGS"] = value
    return subprocess.run(["bash", "-c", f'PY={sys.executable}; {lines[0]}; echo "$KEEP_LOGS"'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("value", "kept"), [*((v, "off") for v in [None, "", *OFF_SPELLINGS]),
                                             *((v, "on") for v in ON_SPELLINGS)])
def test_compose_check_keeps_its_logs_only_when_the_switch_is_on(value: str | None, kept: str) -> None:
    """COMPOSE_CHECK_KEEP_LOGS=0 (or false/no/off) counted as on: the script tested only that it was non-empty."""
    done = keep_logs(value)
    assert done.returncode == 0 and done.stdout.strip() == kept, done.stderr
    script = COMPOSE_CHECK.read_text()
    assert '[ "$KEEP_LOGS" = off ]' in script
    assert not [line for line in script.splitlines() if "COMPOSE_CHECK_KEEP_LOGS" in line
                and not line.startswith(("#", "KEEP_LOGS="))], "read only through client/switches.py"


def test_compose_check_stops_on_a_keep_logs_value_that_is_no_switch() -> None:
    done = keep_logs("disabled")
    assert done.returncode == 2 and "COMPOSE_CHECK_KEEP_LOGS='disabled' is not a switch value" in done.stderr
