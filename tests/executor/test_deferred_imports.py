"""Torch's imports that an eager forward does not use, run after ready (#33, deferred_imports.py): a deferred module's
code runs at its first use (not at its import, nor when inspect or the import system read its metadata), once; the
rest run later in import order and leave the process as a plain import does; the executor reaches ready with torch's
Python meta kernels not yet run, gives the same logits, and runs them after ready; --compile-sizes runs them first."""

from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from client.local import ROOT, wait_until
from executor_service import deferred_imports
from executor_service.activity import StepActivity
from executor_service.default_model.model import make_model
from executor_service.deferred_imports import DeferredModule, defer_torch_imports, install, run_deferred
from tests.support.procs import generate_all, running_stack

PACKAGE = {
    "__init__.py": "from dpkg import seen\nfrom dpkg import first, second\n",
    "seen.py": "import threading\nran = []\nhooks = []\nd1_running, m_running = threading.Event(), threading.Event()\n",
    "first.py": "from dpkg import seen\nseen.ran.append('first')\nvalue = 42\n",
    "second.py": "from dpkg import seen\nseen.ran.append('second')\n",
    "third.py": "from dpkg import seen\nseen.ran.append('third')\n",
    "inner/__init__.py": "from dpkg import seen\nseen.ran.append('inner')\n",
    "inner/child.py": "from dpkg import seen\nseen.ran.append('child')\n",
    "slow.py": "import threading\nstarted, go = threading.Event(), threading.Event()\nearly = 1\nstarted.set()\n"
               "go.wait(30)\nlate = 2\n",
    "d1.py": "from dpkg import seen\nseen.d1_running.set()\nseen.m_running.wait(10)\nimport dpkg.m\n",
    "d2.py": "x = 2\n",
    "m.py": "import time\nfrom dpkg import seen\nseen.m_running.set()\nseen.d1_running.wait(10)\ntime.sleep(0.2)\n"
            "from dpkg import d2\ny = d2.x\n",
    "flaky.py": "from dpkg import seen\nseen.ran.append('flaky')\nbefore = 1\n"
                "if seen.ran.count('flaky') == 1:\n    raise OSError('transient')\nafter = 2\n",
    "midway.py": "from dpkg import seen\nseen.ran.append('midway')\nfor arrive in seen.hooks:\n    arrive()\n"
                 "import dpkg.third\nvalue = 7\n",
}


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package `dpkg` on sys.path whose __init__ imports `first` and `second`; sys.meta_path restored after."""
    for name, text in PACKAGE.items():
        (tmp_path / "dpkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dpkg" / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "dpkg" or n.startswith("dpkg.")]:
        del sys.modules[name]


def test_a_deferred_module_runs_at_its_first_use_not_at_its_import(package: Path) -> None:
    install(["dpkg.first"])
    import dpkg
    first = sys.modules["dpkg.first"]
    assert type(first) is DeferredModule and dpkg.seen.ran == ["second"]
    inspect.getframeinfo(sys._getframe(0))  # reads every module's __file__ (torch.library does this at import)
    import dpkg.first
    assert dpkg.seen.ran == ["second"] and first.__name__ == "dpkg.first"
    from dpkg.first import value
    assert value == 42 and dpkg.seen.ran == ["second", "first"]
    assert type(first) is types.ModuleType and first is dpkg.first
    assert isinstance(first.__loader__, importlib.machinery.SourceFileLoader)  # as a plain import leaves it
    assert first.__spec__ is not None and first.__spec__.loader is first.__loader__
    first.value  # noqa: B018 - runs nothing again
    assert dpkg.seen.ran == ["second", "first"]


def test_run_deferred_runs_what_is_left_in_import_order_and_stops_deferring(package: Path) -> None:
    finder = install(["dpkg.second", "dpkg.first", "dpkg.third"])
    import dpkg
    assert finder.pending_names() == ["dpkg.first", "dpkg.second"] and dpkg.seen.ran == []
    assert run_deferred() == 2
    assert dpkg.seen.ran == ["first", "second"] and finder not in sys.meta_path
    assert finder.pending_names() == [] and run_deferred() == 0
    import dpkg.third  # listed, but imported after the deferral ended: runs at its import
    assert dpkg.seen.ran == ["first", "second", "third"]


def test_then_imports_a_module_right_after_its_package_and_nothing_of_it_is_deferred(package: Path) -> None:
    install(["dpkg.first"], {"dpkg": ["dpkg.third", "dpkg.absent"]})  # (torch: rng_prims, for torch.Generator)
    import dpkg
    assert dpkg.seen.ran == ["second", "third"] and type(sys.modules["dpkg.third"]) is types.ModuleType
    assert isinstance(dpkg.__loader__, importlib.machinery.SourceFileLoader) and "dpkg.absent" not in sys.modules


def test_a_submodule_import_runs_its_deferred_package_first_and_a_missing_name_fails_as_usual(
        package: Path) -> None:
    install(["dpkg.inner", "dpkg.missing"])
    import dpkg
    import dpkg.inner
    assert dpkg.seen.ran == ["first", "second"] and type(dpkg.inner) is DeferredModule
    import dpkg.inner.child
    assert dpkg.seen.ran == ["first", "second", "inner", "child"]
    with pytest.raises(ModuleNotFoundError, match=r"dpkg\.missing"):
        import dpkg.missing


def test_another_threads_use_waits_for_the_module_another_thread_is_running(package: Path) -> None:
    finder = install(["dpkg.slow"])
    import dpkg.slow as slow
    runner = threading.Thread(target=finder.run_all)  # the executor's after-ready thread
    runner.start()
    try:
        wait_until(lambda: "started" in types.ModuleType.__getattribute__(slow, "__dict__")
                   and types.ModuleType.__getattribute__(slow, "started").is_set(), timeout=10,
                   what="the module's code to start")
        found: list[object] = []
        user = threading.Thread(target=lambda: found.append(getattr(slow, "late", "missing")))  # the forward thread
        user.start()
        user.join(0.3)
        assert user.is_alive()  # waits for the code the other thread runs, rather than reading a partly run module
    finally:
        types.ModuleType.__getattribute__(slow, "go").set()
        runner.join(10)
    user.join(10)
    assert found == [2] and type(slow) is types.ModuleType


def test_a_thread_that_imports_what_a_running_module_imports_can_use_another_deferred_module(
        package: Path) -> None:
    """The after-ready thread runs d1, which imports m; meanwhile the forward thread imports m, which uses d2 (queued
    after d1): each waits only for the module it needs, not for the whole run (that wait would deadlock)."""
    finder = install(["dpkg.d1", "dpkg.d2"])
    import dpkg.d1
    import dpkg.d2
    runner = threading.Thread(target=finder.run_all, daemon=True)
    user = threading.Thread(target=lambda: importlib.import_module("dpkg.m"), daemon=True)
    runner.start()
    user.start()
    runner.join(10)
    user.join(10)
    assert not runner.is_alive() and not user.is_alive()
    assert sys.modules["dpkg.m"].y == 2 and type(dpkg.d1) is types.ModuleType


def test_a_module_whose_code_fails_stays_deferred_and_runs_again_at_its_next_use(package: Path) -> None:
    install(["dpkg.flaky"])
    import dpkg.flaky
    with pytest.raises(OSError, match="transient"):
        dpkg.flaky.after  # noqa: B018
    assert type(dpkg.flaky) is DeferredModule  # not a module without what its code did not reach
    assert dpkg.flaky.after == 2 and dpkg.seen.ran == ["first", "second", "flaky", "flaky"]
    assert type(dpkg.flaky) is types.ModuleType


def test_the_after_ready_thread_ends_quietly_when_the_event_loop_closed_meanwhile(
        package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM within the deferred imports' run: the loop closes and the process waits for the prefetch thread
    (finish_prefetch) before it exits; the imports' thread then has no loop to hand freeze_heap to."""
    from executor_service.__main__ import finish_start
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    finder = install(["dpkg.slow"])
    import dpkg.slow
    loop = asyncio.new_event_loop()
    finish_start(finder, loop)
    wait_until(lambda: "go" in types.ModuleType.__getattribute__(dpkg.slow, "__dict__"), timeout=10,
               what="the deferred imports to start")
    loop.close()
    types.ModuleType.__getattribute__(dpkg.slow, "go").set()
    for thread in [t for t in threading.enumerate() if t.name == "deferred-imports"]:
        thread.join(10)
    assert failures == [] and dpkg.slow.late == 2


def ran(package_seen: types.ModuleType) -> list[str]:
    return list(package_seen.ran)


def test_the_after_ready_run_starts_no_module_while_a_step_is_in_flight(package: Path) -> None:
    """finish_start's thread waits for a quiet executor (no step in flight, none for a moment) before each deferred
    module: a step never shares the GIL with their code (#33)."""
    from executor_service.__main__ import finish_start
    finder = install(["dpkg.third"])
    import dpkg.third
    activity = StepActivity(quiet_s=0.0)
    loop = asyncio.new_event_loop()
    try:
        with activity.step():
            finish_start(finder, loop, activity)
            wait_until(lambda: activity.waiting == 1 or "third" in dpkg.seen.ran, timeout=10,
                       what="the deferred imports to wait or run")
            assert ran(dpkg.seen) == ["first", "second"], "a deferred module ran while a step was in flight"
        for thread in [t for t in threading.enumerate() if t.name == "deferred-imports"]:
            thread.join(10)
        assert ran(dpkg.seen) == ["first", "second", "third"] and type(dpkg.third) is types.ModuleType
    finally:
        loop.close()


def test_a_step_arriving_midway_through_a_modules_code_holds_its_next_import(package: Path) -> None:
    """The step arrives while a deferred module's code runs: the code stops at its next import until the step is
    answered (it holds no lock another thread needs), then goes on."""
    finder = install(["dpkg.midway"])
    import dpkg.midway
    activity = StepActivity(quiet_s=0.0)
    step = activity.step()
    dpkg.seen.hooks.append(step.__enter__)
    runner = threading.Thread(target=finder.run_all, args=(activity.wait_quiet,), daemon=True)
    runner.start()
    try:
        wait_until(lambda: ("midway" in dpkg.seen.ran and activity.waiting == 1) or "third" in dpkg.seen.ran,
                   timeout=10, what="the module's import to wait or go on")
        assert ran(dpkg.seen) == ["first", "second", "midway"], "the module went on importing during the step"
    finally:
        step.__exit__(None, None, None)
    runner.join(10)
    assert ran(dpkg.seen) == ["first", "second", "midway", "third"] and dpkg.midway.value == 7


def test_a_paused_module_goes_on_when_another_thread_needs_it(package: Path) -> None:
    """The forward thread needs the module whose code stopped for its step (it waits for that module's lock): the
    code goes on rather than wait for a step that waits for it; the step is still in flight when both are done."""
    from executor_service.__main__ import pause_for_steps
    finder = install(["dpkg.midway"])
    import dpkg.midway
    activity = StepActivity(quiet_s=0.0)
    step = activity.step()
    dpkg.seen.hooks.append(step.__enter__)
    runner = threading.Thread(target=finder.run_all, args=(pause_for_steps(activity),), daemon=True)
    runner.start()
    try:
        wait_until(lambda: "midway" in dpkg.seen.ran and activity.waiting == 1, timeout=10,
                   what="the module's code to stop for the step")
        found: list[int] = []
        user = threading.Thread(target=lambda: found.append(dpkg.midway.value), daemon=True)
        user.start()
        user.join(30)
        runner.join(30)
        assert found == [7] and not runner.is_alive() and activity.in_flight == 1
    finally:
        step.__exit__(None, None, None)


def test_torch_is_deferred_only_where_it_is_not_imported_yet_and_of_a_tested_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert deferred_imports.torch_version_on_disk() == tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert defer_torch_imports() is None  # this process imported torch already
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(deferred_imports, "torch_version_on_disk", lambda: (2, 99))
    assert defer_torch_imports() is None
    assert not any(isinstance(f, deferred_imports.DeferredImports) for f in sys.meta_path)


FORCED_PACKING = ["--cpu-gemm", "onednn", "--cpu-skinny-rows", "0"]
"""Linears packed before ready for a choice made here: a choice measured after ready is swapped in between passes
whenever the measurement ends, and could change the last bits of a pass's logits in one process and not the other."""

BACKEND_SCRIPT = """
import hashlib, json, os, sys
from executor_service.__main__ import deferral_for
from executor_service.config import ExecutorConfig
config = ExecutorConfig.from_args(sys.argv[1:])
deferred = deferral_for(config)
from benchmarks.forward_steps import step_items
from executor_service.runner.torch_backend import TorchBackend
backend = TorchBackend.create(config)
at_ready = deferred.pending_names() if deferred is not None else []
def logits():
    steps = [step_items(kind, n, 9, 512, 2) for kind, n in (("prefill", 3), ("decode", 4))]
    out = [backend.run_batch(backend.prepare(items)) for items in steps]
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in out)).hexdigest()
before = logits()
ran = deferred.run_all() if deferred is not None else 0
print(json.dumps({"at_ready": at_ready, "ran": ran, "logits": [before, logits()], "modules": sorted(sys.modules),
                  "deferred_left": [n for n, m in sys.modules.items() if type(m).__name__ == "DeferredModule"]}))
sys.stdout.flush()
os._exit(0)  # as the executor exits (exit_quietly): the packing thread may still run
"""


def run_backend(args: list[str], lazy: bool) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PAGEDSERVE_LAZY_TORCH_IMPORT="1" if lazy else "0")
    done = subprocess.run([sys.executable, "-c", BACKEND_SCRIPT, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          timeout=300, check=True)
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


def test_the_backend_is_ready_before_torchs_meta_kernels_run_and_ends_as_a_plain_import(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=2, vocab_size=512, init_std=0.2)
    args = ["--model", str(model), "--device", "cpu", "--block-size", "8", "--num-gpu-blocks", "64",
            "--startup-cache-dir", "", *FORCED_PACKING]
    lazy, plain = run_backend(args, lazy=True), run_backend(args, lazy=False)
    assert {"torch._meta_registrations", "torch.export"} <= set(lazy["at_ready"])
    assert plain["at_ready"] == [] and plain["ran"] == 0
    assert lazy["deferred_left"] == [] and lazy["modules"] == plain["modules"]
    assert lazy["logits"] == plain["logits"]  # bit-equal, before and after the deferred imports ran


@pytest.mark.slow
def test_compile_sizes_run_the_deferred_imports_before_tracing(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=1, vocab_size=512, init_std=0.2)
    script = """
import json, sys, torch
from executor_service.deferred_imports import DeferredModule
import executor_service.runner.torch_backend as tb
from executor_service.config import ExecutorConfig
deferred = [n for n, m in sys.modules.items() if type(m) is DeferredModule]
backend = tb.TorchBackend.create(ExecutorConfig.from_args(sys.argv[1:]))
from benchmarks.forward_steps import step_items
items = step_items("prefill", 1, 4, 512, 2)
out = backend.run_batch(backend.prepare(items))
print(json.dumps({"deferred": deferred, "left": [n for n, m in sys.modules.items() if type(m) is DeferredModule],
                  "compiled": sorted(backend.compiled.compile_seconds), "finite": bool(out.isfinite().all())}))
"""
    prelude = "from executor_service.deferred_imports import defer_torch_imports\ndefer_torch_imports()\n"
    args = ["--model", str(model), "--device", "cpu", "--block-size", "8", "--num-gpu-blocks", "16",
            "--startup-cache-dir", "", "--compile-sizes", "4", "--cpu-gemm", "onednn"]
    done = subprocess.run([sys.executable, "-c", prelude + script, *args], cwd=ROOT, stdout=subprocess.PIPE,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600, check=True)
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert "torch._meta_registrations" in result["deferred"]
    assert result["left"] == [] and result["compiled"] == [4] and result["finite"]


def served_tokens(tmp_path: Path, extra: list[str]) -> tuple[list[list[int]], str]:
    """Greedy tokens of a few prompts through a scheduler and the embedded model's executor started with `extra`,
    and the executor's log once the deferred imports (if any) have run."""
    tmp_path.mkdir()
    with running_stack(tmp_path, ["--startup-cache-dir", "", *FORCED_PACKING, *extra]) as stack:
        log_path = stack.log_dir / "executor.log"
        outputs = asyncio.run(generate_all(stack.address, num=3, max_tokens=6))
        if "deferred until after ready" in log_path.read_text():
            wait_until(lambda: "deferred torch imports run after ready" in log_path.read_text(), timeout=60,
                       what="the deferred imports to run")
        return [ids for ids, _ in outputs], log_path.read_text()


def test_the_executor_runs_the_deferred_imports_after_ready_and_serves_the_same_tokens(tmp_path: Path) -> None:
    lazy, lazy_log = served_tokens(tmp_path / "lazy", [])
    plain, plain_log = served_tokens(tmp_path / "plain", ["--no-lazy-torch-import"])
    ready_line = next(line for line in lazy_log.splitlines() if "torch imports deferred until after ready" in line)
    assert "torch._meta_registrations" in ready_line and "torch.export" in ready_line
    assert "deferred torch imports run after ready" in lazy_log
    assert "deferred" not in plain_log
    assert lazy == plain and all(len(ids) == 6 for ids in lazy)


def test_a_thread_waiting_for_a_module_lock_the_paused_thread_holds_is_seen() -> None:
    """pause_for_steps gives way (instead of waiting up to MAX_PAUSE_S with a step stuck behind it) when another
    thread waits for a module whose import the paused thread holds. The import system records the waiters as a dict
    in 3.11 and as a weak-value mapping, not a dict, in 3.12+ (the GPU image's Ubuntu 24.04 Python): both read."""
    from executor_service.deferred_imports import lock_holder_is_awaited, module_lock

    assert lock_holder_is_awaited() is False
    name, seen, held = "pagedserve_test_module_held_while_paused", [], threading.Event()

    def wait_for_it() -> None:
        held.wait()
        with module_lock(name, threading.RLock()):
            pass

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    with module_lock(name, threading.RLock()):
        held.set()
        deadline = time.monotonic() + 60  # the waiter blocks on the lock within milliseconds
        while not (awaited := lock_holder_is_awaited()) and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append(awaited)
    waiter.join()
    assert seen == [True]


def test_the_after_ready_work_runs_anyway_under_load_that_never_pauses(package: Path) -> None:
    """A step always in flight (a steady load): the waits give up `limit_s` after the first, so the deferred modules
    run and the heap is frozen in a busy executor too, instead of never."""
    from executor_service.__main__ import pause_for_steps
    finder = install(["dpkg.midway"])
    import dpkg.midway
    activity = StepActivity(quiet_s=0.0)
    with activity.step():
        runner = threading.Thread(target=finder.run_all, args=(pause_for_steps(activity, limit_s=0.2),), daemon=True)
        runner.start()
        runner.join(10)
        assert not runner.is_alive(), "the deferred imports still wait for a quiet moment"
        assert dpkg.midway.value == 7 and activity.in_flight == 1
