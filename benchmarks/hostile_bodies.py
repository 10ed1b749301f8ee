"""How long one hostile HTTP body holds the other streams of its api server: the longest gap between two chunks of
a canary SSE stream while the body is sent and answered, for bodies of --mib MiB whose shapes cost the event loop
per value (token ids, `[1]` lists, messages, logit_bias keys, unknown fields of numbers, long decimals), against a
string body of the same size (the control: one value). Each tree's scheduler (this one, and any --tree NAME=DIR,
whose code runs in the same run on the same box) serves a simulated executor, so the figures are the api server's.

    python -m benchmarks.hostile_bodies [--mib 8] [--tree base=/tmp/old-checkout]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import decimal
import itertools
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp

from benchmarks.grpc_per_request import start_in
from client.local import ROOT, loopback, stop, wait_until
from client.port_file import wait_ports
from executor_service.default_model.model import ensure_default_model

with decimal.localcontext() as exact:
    exact.prec = 800
    HARD_DECIMAL = str(decimal.Decimal(2) ** -1075).encode()
"""2**-1075 in full (758 characters): halfway between 0 and the smallest float, so json.loads reads it to its last
digit to round it (~55 us each): few items, much work."""
Body = Callable[[int], tuple[str, bytes]]  # size in bytes -> (path, body)
BODIES: dict[str, Body] = {
    "control: one string": lambda n: ("completions", b'{"max_tokens":1,"prompt":"' + b"a" * n + b'"}'),
    "token-id prompt": lambda n: ("completions", b'{"max_tokens":1,"prompt":[' + b"1," * (n // 2) + b"1]}"),
    "stop_token_ids": lambda n: ("completions", b'{"prompt":"hi","stop_token_ids":[' + b"1," * (n // 2) + b"1]}"),
    "unknown field of numbers": lambda n: ("completions", b'{"prompt":"hi","max_tokens":1,"x":[' + b"1," * (n // 2)
                                           + b"1]}"),
    "prompt as [1] lists": lambda n: ("completions", b'{"max_tokens":1,"prompt":[' + b"[1]," * (n // 4) + b"[1]]}"),
    "messages": lambda n: ("chat/completions", b'{"max_tokens":1,"messages":[' + b'{"role":"user"},' * (n // 16)
                           + b'{"role":"user"}]}'),
    "logit_bias keys": lambda n: ("completions", b'{"prompt":"hi","logit_bias":{'
                                  + b",".join(b'"%d":1' % i for i in range(n // 9)) + b"}}"),
    "767-digit decimals": lambda n: ("completions", b'{"prompt":"hi","max_tokens":1,"x":['
                                     + b",".join([HARD_DECIMAL] * (n // len(HARD_DECIMAL))) + b"]}"),
}


@contextlib.contextmanager
def http_stack(tree: Path, label: str, log_dir: Path) -> Iterator[str]:
    """A simulated executor and a scheduler with the HTTP api, both run from `tree`; the HTTP base URL."""
    executor, ex_port = start_in(tree, "executor_service", ["--simulated", "--sim-step-latency-ms", "5"],
                                 log_dir / f"{label}-executor.log")
    try:
        scheduler, _ = start_in(tree, "scheduler_service", [
            "--executor", loopback(ex_port), "--http-listen", "127.0.0.1:0", "--metrics-port", "-1",
            "--tokenizer", str(ensure_default_model())], log_dir / f"{label}-scheduler.log")
        try:
            ports = wait_ports(log_dir / f"{label}-scheduler.ports", ("http_listen",), scheduler, timeout=300.0)
            url = f"http://127.0.0.1:{ports['http_listen']}/v1"
            wait_until(lambda: ready(url), 300, "the HTTP api")
            yield url
        finally:
            stop(scheduler)
    finally:
        stop(executor)


def ready(url: str) -> bool:
    import urllib.request
    with contextlib.suppress(OSError):
        return urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2).status == 200
    return False


async def canary_gap(session: aiohttp.ClientSession, url: str, path: str, body: bytes) -> tuple[int, float, float]:
    """(status, seconds to answer, the canary's longest gap while the body was sent and answered)."""
    arrivals: list[float] = []
    canary = {"prompt": "canary", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/completions", json=canary) as stream:
        if stream.status != 200:
            raise RuntimeError(f"the canary stream was refused: {await stream.text()}")

        async def read() -> None:
            async for _ in stream.content:
                arrivals.append(time.monotonic())

        reader = asyncio.create_task(read())
        while len(arrivals) < 20 and not reader.done():
            await asyncio.sleep(0.01)
        start = time.monotonic()
        async with session.post(f"{url}/{path}", data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            status = r.status
        end = time.monotonic()
        await asyncio.sleep(0.2)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b >= start and a <= end]
    return status, end - start, max(gaps, default=0.0)


async def measure(url: str, size: int) -> dict[str, tuple[int, float, float]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return {name: await canary_gap(session, url, *build(size)) for name, build in BODIES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=8.0, help="size of each body")
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR: also measure another checkout")
    args = parser.parse_args()
    trees = [("this", ROOT), *((t.split("=", 1)[0], Path(t.split("=", 1)[1])) for t in args.tree)]
    size = int(args.mib * 2**20)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, tree in trees:
            with http_stack(tree, label, Path(tmp)) as url:
                results[label] = asyncio.run(measure(url, size))
    print(f"{args.mib:g} MiB bodies: status, seconds to answer, the canary stream's longest gap (x the control's)")
    for name in BODIES:
        cells = []
        for label, _ in trees:
            status, took, gap = results[label][name]
            control = results[label]["control: one string"][2] or 1e-9
            cells.append(f"{label}: {status} {took:6.2f} s  gap {gap:6.2f} s ({gap / control:5.1f}x)")
        print(f"  {name:26s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
