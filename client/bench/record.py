"""How benchmark results are recorded: one JSON line each, with the machine they were measured on."""

from __future__ import annotations

import json
import os
import platform


def machine() -> dict[str, object]:
    """What the numbers were measured on, and how busy it was (other work shares these cores)."""
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_1m": round(load[0], 2), "loadavg_5m": round(load[1], 2)}


def emit(record: dict[str, object], json_out: str | None = None) -> None:
    """Print one JSON line; also append it to json_out when given."""
    line = json.dumps(record)
    print(line, flush=True)
    if json_out:
        with open(json_out, "a", encoding="utf-8") as f:
            f.write(line + "\n")
