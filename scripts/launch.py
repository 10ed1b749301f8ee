"""Run the executor and the scheduler as two local processes, stream one demo generation, wait for Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import textwrap
import time

from client.lib import PagedServeClient


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pagedserve: both services in the foreground")
    p.add_argument("--listen", default="127.0.0.1:50051", help="public gRPC address of the scheduler")
    p.add_argument("--http-listen", default="127.0.0.1:8080", help="OpenAI-compatible HTTP API address")
    p.add_argument("--executor-listen", default="127.0.0.1:50061", help="executor gRPC address")
    p.add_argument("--metrics-port", type=int, default=8000, help="scheduler Prometheus port")
    p.add_argument("--simulated", action="store_true", help="use the model-free simulated executor")
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded model)")
    p.add_argument("--prompt", default="Once upon a time, there was", help="demo prompt streamed once ready")
    p.add_argument("--no-demo", action="store_true", help="skip the demo generation")
    return p.parse_args()


async def wait_healthy(address: str, procs: list[subprocess.Popen[bytes]], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    async with PagedServeClient(address) as client:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a service exited during start-up; see its log above")
            try:
                if await client.health(timeout=1.0):
                    return
            except Exception:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"{address} did not become healthy within {timeout:.0f}s")


async def demo(address: str, prompt: str) -> None:
    """The prompt and its greedy continuation, wrapped, printed in one piece once it is complete (the
    services log to the same terminal, so streamed text would be interleaved with their lines)."""
    text = ""
    async with PagedServeClient(address) as client:
        async for r in client.generate(prompt, max_tokens=64, temperature=0.0):
            text += r.text
    rule = "-" * 72
    body = "\n".join(textwrap.wrap(prompt + text, width=72))
    print(f"\n{rule}\ndemo: {prompt!r}, continued greedily by the model\n{rule}\n{body}\n{rule}", flush=True)


def ready_message(args: argparse.Namespace) -> str:
    url = f"http://{args.http_listen}"
    body = '{"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}'
    return (f"\npagedserve ready: gRPC on {args.listen}, OpenAI-compatible HTTP on {url}/v1, "
            f"metrics on http://127.0.0.1:{args.metrics_port}/metrics. Try:\n"
            f"  .venv/bin/python -m client generate --server {args.listen} --max-tokens 48 \"Once upon a time\"\n"
            f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
            "Ctrl-C stops both services.")


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
                                  args.executor_listen, "--metrics-port", str(args.metrics_port),
                                  "--http-listen", args.http_listen])
    procs = [executor, scheduler]
    try:
        asyncio.run(wait_healthy(args.listen, procs))
        if not args.no_demo:
            asyncio.run(demo(args.listen, args.prompt))
        print(ready_message(args), flush=True)
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
