"""Find or build llama.cpp's `llama-server`, and convert a Hugging Face directory to GGUF with llama.cpp's own
converter, for benchmarks/vs_llamacpp.py (#29).

The sources come from the `llama-cpp-python` sdist on the package registry (`pip download --no-binary :all:`, its
vendor/llama.cpp); cmake and a C++ compiler build `llama-server` alone (-DGGML_NATIVE=ON: the CPU's own ISA, as our
kernels' -march=native), under the cache directory (default ~/.cache/pagedserve/llama.cpp), so later runs reuse it.
Every step returns None with a reason where it cannot be done here: the benchmark then skips cleanly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE_ENV = "PAGEDSERVE_LLAMACPP_DIR"
SERVER_ENV = "LLAMA_SERVER"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pagedserve" / "llama.cpp"
    return Path(os.environ.get(CACHE_ENV) or default)


def source_dir(root: Path) -> Path | None:
    """vendor/llama.cpp of an unpacked llama-cpp-python sdist under root/src (downloaded and unpacked if none)."""
    found = sorted(root.glob("src/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[-1].parent
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(src),
           "llama-cpp-python"]
    if subprocess.run(pip, capture_output=True, timeout=600).returncode != 0:
        return None
    for archive in src.glob("llama_cpp_python-*.tar.gz"):
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    found = sorted(root.glob("src/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    return found[-1].parent if found else None


def find_server(build: bool = True) -> tuple[Path | None, str]:
    """llama-server: $LLAMA_SERVER, else on PATH, else the cached build, else (build) built now."""
    named = os.environ.get(SERVER_ENV) or shutil.which("llama-server")
    if named:
        return Path(named), "given"
    root = cache_dir()
    sources = sorted(root.glob("src/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
    if sources:
        return sources[-1], "cached build"
    if not build:
        return None, "no llama-server built (run without --no-build)"
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        return None, "cmake or a C++ compiler is missing"
    llama = source_dir(root)
    if llama is None:
        return None, "the llama-cpp-python sdist could not be downloaded"
    return build_server(llama)


def build_server(llama: Path) -> tuple[Path | None, str]:
    configure = ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    steps = [configure, ["cmake", "--build", "build", "--target", "llama-server", f"-j{os.cpu_count() or 1}"]]
    for step in steps:
        done = subprocess.run(step, cwd=llama, capture_output=True, text=True)
        if done.returncode != 0:
            return None, f"{' '.join(step[:3])} failed: {done.stderr.strip().splitlines()[-1:]}"
    server = llama / "build" / "bin" / "llama-server"
    return (server, "built now") if server.is_file() else (None, "the build made no llama-server")


CONVERT = """
import sys
llama, model, out, outtype = sys.argv[1:5]
sys.path[:0] = [llama, llama + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile", out]
import conversion.base as base
# The benchmark model's tokenizer (byte-level BPE, GPT-2's pre-tokenizer regex) is not in the converter's list of
# known pre-tokenizer hashes; its pre-tokenizer is GPT-2's, so say so instead of the hash lookup.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert(model: Path, server: Path, outtype: str = "f32") -> tuple[Path | None, str]:
    """model as GGUF (cached beside the server's build, keyed by the model's name, size and time)."""
    llama = server.parents[2] if server.parent.name == "bin" else None
    if llama is None or not (llama / "convert_hf_to_gguf.py").is_file():
        return None, f"no convert_hf_to_gguf.py beside {server}"
    weights = sorted(model.glob("*.safetensors"))
    stamp = "-".join(f"{w.stat().st_size}-{int(w.stat().st_mtime)}" for w in weights)
    out = cache_dir() / "gguf" / f"{model.name}-{stamp}-{outtype}.gguf"
    if out.is_file():
        return out, "cached"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    done = subprocess.run([sys.executable, "-c", CONVERT, str(llama), str(model), str(tmp), outtype],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not tmp.is_file():
        return None, f"conversion failed: {done.stderr.strip().splitlines()[-1:]}"
    os.replace(tmp, out)
    return out, "converted"
