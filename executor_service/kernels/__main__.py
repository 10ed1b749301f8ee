"""python -m executor_service.kernels: build every C++ CPU extension ahead of time (scripts/setup.sh, the Docker
image)."""

from __future__ import annotations

import logging

from executor_service.attention import cpu as attention
from executor_service.kernels.build import kernel_dir
from executor_service.model import cpu_ops


def main() -> int:
    """Exit status 1 if one extension cannot be built here (the executor then runs its torch fallback)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = {"CPU paged attention": attention.load(),
             "CPU model ops (packed and skinny linear, RoPE + KV write, RMSNorm, SiLU-and-mul)": cpu_ops.load()}
    for name, ok in built.items():
        print(f"{name}: {'built' if ok else 'NOT built (torch fallback)'} in {kernel_dir()}")
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
