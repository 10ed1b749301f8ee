"""Parts of torch's import that eager inference does not need before its first token, run after ready (#33).

A warm start is mostly `import torch` (1.1 - 2 s on two cores), and 0.25 - 0.5 s of that is modules torch's
`__init__` imports for what an eager forward never calls: its Python meta kernels (`torch._meta_registrations`,
which pulls in `torch._decomp` and `torch._refs`: for meta and fake tensors, i.e. torch.compile and
torch.export), `torch.export` itself and `torch.nested`. install() puts a finder in front of sys.meta_path just
before torch is imported; for those names it lets the import create the module but not run its code (the module
is a DeferredModule). The first access to anything but a module's import metadata (__name__, __file__, __spec__,
...) runs its code, under a lock, as the import would have: `torch.export.export(...)`, `from torch.export
import ...` and `import torch.nested._internal` all find the real module. What eager code needs of their side
effects is imported right after torch (EAGER_AFTER_TORCH: torch._prims' rng_prims, for torch.Generator).
run_deferred() runs whatever is still deferred, in the order the imports came, and removes the finder: the
process is then in the state a plain `import torch` leaves (the same modules, registrations and attributes).
The executor runs them on a low-priority thread from a moment after ready, only while no step is in flight
(__main__.py, activity.py: run_all's `pause` before each module and each module their code imports), and before
anything that traces or uses fake tensors (runner/compiled.py).

Robust to a torch that names or imports these differently: only a tested torch version is deferred
(TESTED_TORCH); a name the path finder does not find, or a module whose loader cannot split creation from
execution, is imported as usual; a module torch touches during its own import runs then. Off with
--no-lazy-torch-import or PAGEDSERVE_LAZY_TORCH_IMPORT=0 (any off spelling of client/switches.py)."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import logging
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from executor_service.placement import lower_thread_priority

if TYPE_CHECKING:
    from importlib.abc import Loader

log = logging.getLogger("pagedserve.executor")
DEFERRED_TORCH_MODULES = (
    "torch._meta_registrations",
    "torch.distributed._meta_registrations",
    "torch.export",
    "torch.nested",
)
EAGER_AFTER_TORCH = ("torch._prims.rng_prims",)
"""What a deferred module imports whose side effects eager code needs, imported right after torch's own import:
in torch 2.13 torch.Generator() needs the metaclass rng_prims sets (imported by _meta_registrations' _decomp)."""
METADATA = frozenset({"__name__", "__file__", "__spec__", "__loader__", "__package__", "__cached__", "__class__"})
"""What the import system, inspect.getmodule and a module's repr read of every module in sys.modules: reading
these does not run a deferred module (its __path__ does: a submodule's import runs its package first)."""


TESTED_TORCH = ((2, 13),)
"""torch versions (major, minor) the deferral was tested on. Another version imports torch as usual: deferring a
module changes which module first imports what it imports, and in another torch that order could meet a circular
import that the usual order does not (as deferring torch.quantization does in 2.13)."""


def torch_version_on_disk() -> tuple[int, int] | None:
    """torch's (major, minor) from its version.py, without importing torch; None where it cannot be read."""
    try:
        spec = importlib.util.find_spec("torch")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        text = Path(locations[0], "version.py").read_text(encoding="utf-8") if locations else ""
    except (OSError, ValueError, ImportError):
        return None
    found = re.search(r"^__version__\s*=\s*['\"](\d+)\.(\d+)", text, re.MULTILINE)
    return (int(found.group(1)), int(found.group(2))) if found else None


@dataclass
class Pending:
    """What a DeferredModule needs to run: its real loader, the spec's own loader_state, the finder (its lock)."""

    loader: Loader
    loader_state: Any
    finder: DeferredImports


class DeferredModule(types.ModuleType):
    """A module created by the import whose code has not run yet; any attribute but METADATA runs it first."""

    def __getattribute__(self, attr: str) -> Any:
        if attr in METADATA:
            return types.ModuleType.__getattribute__(self, attr)
        spec = types.ModuleType.__getattribute__(self, "__spec__")
        pending = spec.loader_state if spec is not None else None
        if isinstance(pending, Pending):
            pending.finder.run(self, spec, pending)
        return types.ModuleType.__getattribute__(self, attr)


class Wrapping:
    """A loader that stands in for `real` for one import: creates the module as `real` would and gives it back
    `real` as its loader (what a plain import leaves there) before running it."""

    def __init__(self, real: Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def hand_back(self, module: types.ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        module.__loader__ = self.real


class DeferredLoader(Wrapping):
    """Creates the module as `real` would and leaves its execution to the first use (DeferredModule)."""

    def __init__(self, real: Loader, finder: DeferredImports) -> None:
        super().__init__(real)
        self.finder = finder

    def exec_module(self, module: types.ModuleType) -> None:
        spec = module.__spec__
        if spec is None or type(module) is not types.ModuleType:  # a custom module type: run it as usual
            self.real.exec_module(module)
            return
        self.hand_back(module)
        spec.loader_state = Pending(self.real, spec.loader_state, self.finder)
        module.__class__ = DeferredModule
        self.finder.deferred.append(module)


class ThenImport(Wrapping):
    """Runs `real`'s module, then imports `names` (a name that does not import is logged and left out)."""

    def __init__(self, real: Loader, names: Sequence[str]) -> None:
        super().__init__(real)
        self.names = tuple(names)

    def exec_module(self, module: types.ModuleType) -> None:
        self.hand_back(module)
        self.real.exec_module(module)
        for name in self.names:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                log.info("%s not imported after %s (%s)", name, module.__name__, exc)


class PauseFirst(Wrapping):
    """Runs `real`'s module after `pause()` returns (the import system's global lock is not held then; the module's
    own lock and those of the modules importing it are, and a thread waiting for one shows in _BLOCKING_ON)."""

    def __init__(self, real: Loader, pause: Callable[[], object]) -> None:
        super().__init__(real)
        self.pause = pause

    def exec_module(self, module: types.ModuleType) -> None:
        self.hand_back(module)
        self.pause()
        self.real.exec_module(module)


class DeferredImports:
    """The finder for `names`, first on sys.meta_path until run_all(); `deferred` in the order they were imported.
    `then`: modules to import right after a module's own import (by its name), deferring nothing of theirs."""

    def __init__(self, names: Sequence[str], then: dict[str, Sequence[str]] | None = None) -> None:
        self.names = frozenset(names)
        self.then = dict(then or {})
        self.deferred: list[types.ModuleType] = []
        self.lock = threading.RLock()
        self.running: set[int] = set()
        self.stopped = False  # run_all began: nothing more is deferred
        self.pausing: tuple[int, Callable[[], object]] | None = None  # (thread, pause) while run_all runs there

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        pausing = self.pausing
        if pausing is not None and pausing[0] == threading.get_ident():
            return self.pausing_spec(name, path, target, pausing[1])
        if self.stopped or (name not in self.names and name not in self.then):
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        except Exception as exc:  # never break the import: the usual finders try it again
            log.info("deferred import of %s not possible (%s); importing it now", name, exc)
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        # ducks, not importlib.abc.Loader subclasses: importlib.abc costs 10 ms to import
        wrapped = DeferredLoader(spec.loader, self) if name in self.names else ThenImport(spec.loader, self.then[name])
        spec.loader = cast("Loader", wrapped)
        return spec

    def pausing_spec(self, name: str, path: Sequence[str] | None, target: types.ModuleType | None,
                     pause: Callable[[], object]) -> importlib.machinery.ModuleSpec | None:
        """The spec the other finders give, with a loader that calls `pause` before the module's code runs: run_all's
        thread, importing what a deferred module's code imports. Not here: find_spec runs under the import system's
        global lock, which every other thread's import takes."""
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = cast("Loader", PauseFirst(spec.loader, pause))
                return spec
        return None

    def run(self, module: types.ModuleType, spec: importlib.machinery.ModuleSpec, pending: Pending) -> None:
        """Run `module`'s code once, under the import system's lock for its name, as its import would have: the
        first thread to need it runs it and others wait for it (the spec keeps `pending` until the code has run:
        no other thread reads a partly run module), unless waiting would deadlock (that thread holds the lock of a
        module the code imports), where it goes on with the partly run module, as in an import cycle between
        threads; an access from the code itself sees the partly run module, as in a circular import. Code that
        fails raises here and leaves the module deferred, as a failed import leaves it unimported: the next access
        runs it again (and raises again), rather than finding a module without what its code did not reach."""
        lock = module_lock(module.__name__, self.lock)
        try:
            lock.__enter__()
        except DEADLOCK_ERRORS:  # only the wait itself: an import cycle's error in the code is the code's
            return
        try:
            if spec.loader_state is not pending or id(module) in self.running:
                return
            self.running.add(id(module))
            try:
                pending.loader.exec_module(module)  # file loaders do not read spec.loader_state
            finally:
                self.running.discard(id(module))
            spec.loader_state = pending.loader_state
            module.__class__ = types.ModuleType
        finally:
            lock.__exit__(None, None, None)

    def pending_names(self) -> list[str]:
        """The modules still deferred, in import order."""
        return [m.__name__ for m in self.deferred if type(m) is DeferredModule]

    def run_all(self, pause: Callable[[], object] | None = None) -> int:
        """Run every module still deferred, in import order, and stop deferring; the number run. `pause` is called
        before each module and before each import their code makes on this thread (this finder sees them until the
        end), so that the work can wait for a quiet moment between any two imports."""
        with self.lock:
            self.stopped = True
            modules = list(self.deferred)
        if pause is not None:
            self.pausing = (threading.get_ident(), pause)
        try:
            count = 0
            for module in modules:  # each under its own lock (run)
                if pause is not None and type(module) is DeferredModule:
                    pause()
                count += run_module(module)
        finally:
            self.pausing = None
            with self.lock:
                sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        with self.lock:
            self.deferred[:] = [m for m in self.deferred if type(m) is DeferredModule]
        return count


_BOOTSTRAP = getattr(importlib, "_bootstrap", None)
_MODULE_LOCK: Callable[[str], contextlib.AbstractContextManager[Any]] | None = getattr(
    _BOOTSTRAP, "_ModuleLockManager", None)
DEADLOCK_ERRORS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(_BOOTSTRAP, "_DeadlockError", None),) if isinstance(e, type))
"""The import system's per-name locks and the error their deadlock detection raises (CPython's importlib
internals): a thread waiting for a deferred module another thread runs is then part of that detection."""


_BLOCKING_ON: Any = getattr(_BOOTSTRAP, "_blocking_on", None)
"""The import system's record of the module lock each thread is waiting for (CPython 3.11: a dict, thread id ->
lock; 3.12+: a _WeakValueDictionary, not a dict, whose `data` maps thread id -> a weak reference to a list of
locks)."""


def blocked_threads() -> list[tuple[int, Any]] | None:
    """(thread id, lock it waits for) for each thread waiting for a module lock; None where this Python does not
    tell. RuntimeError where the record changed while read."""
    table = _BLOCKING_ON
    if isinstance(table, dict):
        entries = list(table.items())
    elif isinstance(getattr(table, "data", None), dict):
        entries = [(tid, ref()) for tid, ref in list(table.data.items()) if callable(ref)]
    else:
        return None
    return [(tid, lock) for tid, entry in entries if entry is not None
            for lock in (entry if isinstance(entry, list) else (entry,))]


def lock_holder_is_awaited() -> bool | None:
    """Whether another thread waits for a module lock this thread holds (it needs a module this thread's imports are
    running); None where this Python does not tell."""
    me = threading.get_ident()
    try:
        waits = blocked_threads()
    except RuntimeError:  # changed while read: ask again at the next poll
        return False
    if waits is None:
        return None
    return any(tid != me and getattr(lock, "owner", None) == me for tid, lock in waits)


def module_lock(name: str, fallback: threading.RLock) -> contextlib.AbstractContextManager[Any]:
    """The import system's lock for `name` (re-entrant, deadlock-detecting), or `fallback` where there is none."""
    return _MODULE_LOCK(name) if _MODULE_LOCK is not None and DEADLOCK_ERRORS else fallback


def install(names: Sequence[str], then: dict[str, Sequence[str]] | None = None) -> DeferredImports:
    """Defer `names` in the imports to come (a module already imported stays as it is); `then` as for
    DeferredImports."""
    finder = DeferredImports(names, then)
    sys.meta_path.insert(0, finder)
    return finder


def defer_torch_imports() -> DeferredImports | None:
    """install(DEFERRED_TORCH_MODULES) before torch's import, where torch is a TESTED_TORCH version; None (torch
    imports as usual) where it is not, cannot be told, or torch is already imported."""
    if "torch" in sys.modules:
        return None
    version = torch_version_on_disk()
    if version not in TESTED_TORCH:
        log.info("torch %s: its import is not deferred (tested on %s)", version,
                 ", ".join(f"{major}.{minor}" for major, minor in TESTED_TORCH))
        return None
    return install(DEFERRED_TORCH_MODULES, {"torch": EAGER_AFTER_TORCH})


def run_in_background(finder: DeferredImports, then: Callable[[], object],
                      pause: Callable[[], object] | None = None) -> threading.Thread:
    """Run what `finder` deferred on a daemon thread at the lowest CPU priority, log it, then call `then` (on that
    thread); `pause` as for run_all, and once more before `then`. A module whose code fails is logged: the forward
    does not use it (its import would have failed the start without the deferral)."""

    def run() -> None:
        lower_thread_priority()
        names, t0 = finder.pending_names(), time.perf_counter()
        try:
            finder.run_all(pause)
            log.info("deferred torch imports run after ready (%.2f s, pauses for steps included): %s",
                     time.perf_counter() - t0, ", ".join(names) or "none left")
        except Exception as exc:
            log.warning("a deferred torch import failed after ready (%s: %s); torch.compile and meta tensors may "
                        "not work in this process", type(exc).__name__, exc)
        if pause is not None:
            pause()
        then()

    thread = threading.Thread(target=run, name="deferred-imports", daemon=True)
    thread.start()
    return thread


def run_deferred() -> int:
    """Run every deferred import of this process (whichever DeferredImports made them), e.g. before torch.compile
    or torch.export, which need the meta kernels; the number of modules run."""
    finders = [f for f in sys.meta_path if isinstance(f, DeferredImports)]
    modules = [m for m in list(sys.modules.values()) if type(m) is DeferredModule]
    count = sum(finder.run_all() for finder in finders)
    return count + sum(run_module(module) for module in modules)  # those of a finder already removed


def run_module(module: types.ModuleType) -> bool:
    """Run `module`'s code if it is still deferred; whether it was."""
    if type(module) is not DeferredModule:
        return False
    module.__doc__  # noqa: B018 - any attribute but the import metadata runs it
    return True
