"""Benchmarks: run each from the repository root as a module, e.g. `python -m benchmarks.executor`."""
