"""benchmarks/rolling_restart.py at a small size (#28): every tier restarted in turn (front-end SIGTERM and
SIGKILL, engine core SIGKILL and SIGTERM, executor SIGKILL) under streaming load; no client-library stream fails.
HTTP streams of the SIGKILLed front-end may end (HTTP clients cannot resume); every other HTTP stream completes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.rolling_restart import run


async def test_every_tier_restarts_without_a_failed_client_library_stream(tmp_path: Path) -> None:
    args = argparse.Namespace(streams=12, http_streams=2, max_tokens=100, step_ms=10, settle=1.0)
    result: dict[str, Any] = await run(args, tmp_path)
    assert result["failed"]["grpc"] == 0, result["errors"]
    assert all("after frontend SIGKILL" in e for e in result["errors"] if e.startswith("http")), result["errors"]
    assert result["completed"]["grpc"] >= 12 and result["completed"]["http"] >= 2, result
    assert result["tokens_resubmitted_by_frontends"] > 0, "the core restarts had requests in flight"
