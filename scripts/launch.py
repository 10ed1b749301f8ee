"""Run the executor and the scheduler as two local processes, stream one demo generation, wait for Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time

from client.lib import PagedServeClient
from client.local import wait_healthy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pagedserve: both services in the foreground")
    p.add_argument("--listen", default="127.0.0.1:50051", help="public gRPC address of the scheduler")
    p.add_argument("--executor-listen", default="127.0.0.1:50061")
    p.add_argument("--metrics-port", type=int, default=8000)
    p.add_argument("--simulated", action="store_true", help="use the model-free simulated executor")
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded model)")
    p.add_argument("--prompt", default="The scheduler decides", help="demo prompt streamed once ready")
    p.add_argument("--no-demo", action="store_true")
    return p.parse_args()


async def demo(address: str, prompt: str) -> None:
    print(f"\n--- streaming a demo generation for {prompt!r} ---", flush=True)
    async with PagedServeClient(address) as client:
        async for r in client.generate(prompt, max_tokens=32, temperature=0.0):
            print(r.text, end="", flush=True)
    print("\n---", flush=True)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    args = parse_args()
    py = sys.executable
    source = ["--simulated"] if args.simulated else (["--model", args.model] if args.model else [])
    executor = subprocess.Popen([py, "-m", "executor_service", "--listen", args.executor_listen, *source])
    scheduler = subprocess.Popen([py, "-m", "scheduler_service", "--listen", args.listen, "--executor",
                                  args.executor_listen, "--metrics-port", str(args.metrics_port)])
    procs = [executor, scheduler]
    try:
        try:
            wait_healthy(args.listen, *procs, timeout=300.0)
        except (RuntimeError, TimeoutError) as e:
            raise SystemExit(f"{e}; see the services' log above") from None
        if not args.no_demo:
            asyncio.run(demo(args.listen, args.prompt))
        print(f"\npagedserve ready on {args.listen} (metrics http://127.0.0.1:{args.metrics_port}/metrics)."
              f" Try:\n  .venv/bin/python -m client generate --server {args.listen} --max-tokens 32 \"Hello\"\n"
              "Ctrl-C stops both services.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
