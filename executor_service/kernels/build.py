"""Build and load the executor's C++ CPU extensions (torch.utils.cpp_extension, g++ and ninja).

Each extension is compiled with -O3 -march=native -fopenmp, with the shared headers of executor_service/kernels/csrc/
on its include path, into PAGEDSERVE_KERNEL_DIR (default ~/.cache/pagedserve/kernels), in a directory keyed by its
sources and those headers, the flags, the torch and Python versions and the CPU's feature flags, so a build is
reused only where it runs. Loading an extension registers its
torch.ops; callers decide what to do when a build fails (every extension has a pure-torch fallback).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNEL_DIR_ENV = "PAGEDSERVE_KERNEL_DIR"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
"""-fopenmp defines _OPENMP, without which ATen's header compiles at::parallel_for as a serial loop (#29)."""
LDFLAGS = ("-fopenmp",)
"""Links libgomp.so.1: the soname of the libgomp torch's CPU wheel ships and has loaded before any extension, so the
loader binds the extension to that same runtime (one OpenMP thread pool in the process, not two). A tuple, and
each build gets its own list: cpp_extension appends its own flags to the list it is given, which changed the next
extension's build key in a process that had built one (so a process that only loaded them looked for another key)."""
SHARED_HEADERS = Path(__file__).resolve().parent / "csrc"


def kernel_dir() -> Path:
    default = Path.home() / ".cache" / "pagedserve" / "kernels"
    return Path(os.environ.get(KERNEL_DIR_ENV) or default)


def build_key(sources: list[Path], cflags: list[str]) -> str:
    digest = hashlib.sha256()
    for source in [*sources, *sorted(SHARED_HEADERS.glob("*.h"))]:
        digest.update(source.read_bytes())
    digest.update(" ".join([*cflags, *LDFLAGS, torch.__version__, sys.version]).encode())
    digest.update(cpu_flags().encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def build_extension(name: str, sources: list[Path], extra_cflags: tuple[str, ...] = ()) -> None:
    """Load the extension `name` built for these sources, flags and machine (a prebuilt one needs no compiler, as in
    the Docker image), else compile it; raises when it cannot be built here. torch.utils.cpp_extension is imported
    only to compile (it imports setuptools, packaging and distutils: 0.1 - 0.2 s of a start, #33)."""
    cflags = [*CFLAGS, *extra_cflags]
    directory = kernel_dir() / f"{name}-{build_key(sources, cflags)}"
    if load_prebuilt(directory / f"{name}.so"):
        return
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    env_bin = str(Path(sys.executable).parent)  # a pip-installed ninja lives beside the interpreter
    if shutil.which("ninja") is None and env_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = env_bin + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
                       extra_ldflags=list(LDFLAGS), extra_include_paths=[str(SHARED_HEADERS)],
                       build_directory=str(directory), is_python_module=False, verbose=False)


def load_prebuilt(library: Path) -> bool:
    """Load a library a finished build left; False if there is none, a build holds the directory's lock (the
    library may be half linked: let cpp_extension wait for it), or it does not load (then it is removed, so that
    the build links it again instead of finding it up to date)."""
    if not library.is_file() or (library.parent / "lock").exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as e:
        log.warning("could not load %s (%s); building it again", library, e)
        library.unlink(missing_ok=True)
        return False
    return True


def try_build(name: str, sources: list[Path], what: str, fallback: str, extra_cflags: tuple[str, ...] = ()) -> bool:
    """build_extension, or False with one warning (`what` unavailable, using `fallback`) when it fails here."""
    try:
        build_extension(name, sources, extra_cflags)
    except Exception as e:  # any build failure means: use the torch fallback
        log.warning("%s unavailable (%s); using %s", what, str(e).splitlines()[0], fallback)
        return False
    return True

