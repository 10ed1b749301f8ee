"""`pagedserve serve [MODEL]`: the executor and the scheduler as two local processes in the foreground, one demo
generation once they are ready, until SIGINT (Ctrl-C) or SIGTERM. What `scripts/up.sh` runs.

The services log to this process's terminal. On a signal the scheduler stops first (it drains what is in
flight while the executor still runs it), then the executor; each is killed if it outlives its grace period.
If either service exits on its own, the other is stopped and the exit status is 1. On Linux the services
also get SIGTERM if this process dies without stopping them (killed), so none is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds each service gets to stop after SIGTERM before it is killed. The scheduler drains in-flight
# requests for up to its --shutdown-timeout (30 s by default), and its api servers a little longer.
GRACE_S = {"scheduler": 45.0, "executor": 15.0}
READY_LINE = "pagedserve ready"
DEMO_TIMEOUT_S = 120.0  # a demo that takes longer (a stuck engine, a large model on a slow CPU) is skipped


def build_parser(prog: str = "pagedserve serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run the executor and the scheduler on this machine in the "
                                "foreground, stream one demo generation, and serve until Ctrl-C.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face model directory (Llama, Mistral, Qwen2; default: the embedded model)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="DIR", help="the same as MODEL")
    p.add_argument("--simulated", action="store_true", help="use the model-free simulated executor")
    p.add_argument("--listen", default="127.0.0.1:50051", help="public gRPC address of the scheduler")
    p.add_argument("--http-listen", default="127.0.0.1:8080", help="OpenAI-compatible HTTP API address")
    p.add_argument("--executor-listen", default="127.0.0.1:50061", help="executor gRPC address")
    p.add_argument("--metrics-port", type=int, default=8000, help="scheduler Prometheus port")
    p.add_argument("--prompt", default="Once upon a time, there was", help="demo prompt streamed once ready")
    p.add_argument("--no-demo", action="store_true", help="skip the demo generation")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model and args.model_flag and args.model != args.model_flag:
        parser.error("MODEL and --model name different directories")
    args.model = args.model or args.model_flag
    if args.simulated and args.model:
        parser.error("--simulated runs no model: leave out MODEL")
    return args


def service_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The two services' command lines, in start order."""
    py = sys.executable
    source = ["--simulated"] if args.simulated else (["--model", args.model] if args.model else [])
    return {
        "executor": [py, "-m", "executor_service", "--listen", args.executor_listen, *source],
        "scheduler": [py, "-m", "scheduler_service", "--listen", args.listen, "--executor", args.executor_listen,
                      "--metrics-port", str(args.metrics_port), "--http-listen", args.http_listen],
    }


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel send the child SIGTERM when this process dies (Linux only). The
    services are started before this process has any other thread, where preexec_fn is safe."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def console_command() -> str:
    """How to run the `pagedserve` script that sits beside this Python, as a user would type it here."""
    script = Path(sys.executable).parent / "pagedserve"
    if not script.exists():
        return f"{sys.executable} -m client"
    if shutil.which("pagedserve") == str(script):
        return "pagedserve"
    with contextlib.suppress(ValueError):
        return str(script.relative_to(Path.cwd()))
    return str(script)


def ready_message(args: argparse.Namespace) -> str:
    url = f"http://{args.http_listen}"
    body = '{"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}'
    return (f"\n{READY_LINE}: gRPC on {args.listen}, OpenAI-compatible HTTP on {url}/v1, "
            f"metrics on http://127.0.0.1:{args.metrics_port}/metrics. Try:\n"
            f"  {console_command()} generate --server {args.listen} --max-tokens 48 \"Once upon a time\"\n"
            f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
            "Ctrl-C stops both services.")


async def wait_ready(address: str) -> None:
    """Until the scheduler's health check says SERVING (it does once it has an executor). A fresh channel per
    attempt, so a port that is not bound yet does not put the channel into gRPC's reconnect backoff."""
    import grpc

    from client.lib import PagedServeClient

    while True:
        async with PagedServeClient(address) as client:
            with contextlib.suppress(grpc.aio.AioRpcError):
                if await client.health(timeout=2.0):
                    return
        await asyncio.sleep(0.2)


async def demo(address: str, prompt: str) -> None:
    """The prompt and its greedy continuation, wrapped, printed in one piece once it is complete (the
    services log to the same terminal, so streamed text would be interleaved with their lines)."""
    import grpc

    from client.lib import PagedServeClient

    text = ""
    try:
        async with PagedServeClient(address) as client:
            async for r in client.generate(prompt, max_tokens=64, temperature=0.0, timeout=DEMO_TIMEOUT_S):
                text += r.text
    except grpc.aio.AioRpcError as e:
        print(f"demo generation failed: {e.code().name}: {e.details()}", file=sys.stderr, flush=True)
        return
    rule = "-" * 72
    body = "\n".join(textwrap.wrap(prompt + text, width=72))
    print(f"\n{rule}\ndemo: {prompt!r}, continued greedily by the model\n{rule}\n{body}\n{rule}", flush=True)


class Supervisor:
    """Watches the services and the stop signals from one event loop."""

    def __init__(self, procs: dict[str, subprocess.Popen[bytes]], signals: list[int]) -> None:
        """signals: those noted before the event loop took them over."""
        self.procs = procs
        self.stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.stop.set)
        if signals:
            self.stop.set()
        self.stopped = asyncio.ensure_future(self.stop.wait())
        self.exits = {name: asyncio.ensure_future(asyncio.to_thread(p.wait)) for name, p in procs.items()}

    async def until_stopped(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run coro; False (and coro cancelled) when a stop signal or a service's exit comes first."""
        task = asyncio.ensure_future(coro)
        await asyncio.wait([task, self.stopped, *self.exits.values()], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return not self.ended()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False

    def ended(self) -> bool:
        return self.stop.is_set() or any(t.done() for t in self.exits.values())

    def outcome(self) -> int:
        """0 after a stop signal; 1 (and a line saying which) when a service exited on its own."""
        if self.stop.is_set():
            return 0
        for name, proc in self.procs.items():
            if proc.returncode is not None:
                print(f"pagedserve serve: the {name} exited with status {proc.returncode}; stopping",
                      file=sys.stderr, flush=True)
        return 1

    async def shut_down(self) -> None:
        """Scheduler first, then executor: SIGTERM, then SIGKILL after its grace period."""
        for name in sorted(self.procs, key=lambda n: n != "scheduler"):
            proc, exited = self.procs[name], self.exits[name]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), timeout=GRACE_S.get(name, 15.0))
            except TimeoutError:
                print(f"pagedserve serve: the {name} did not stop within {GRACE_S.get(name, 15.0):.0f}s; killing it",
                      file=sys.stderr, flush=True)
                proc.kill()
                await exited
        self.stopped.cancel()


async def supervise(args: argparse.Namespace, procs: dict[str, subprocess.Popen[bytes]], signals: list[int]) -> int:
    sup = Supervisor(procs, signals)
    try:
        if not await sup.until_stopped(wait_ready(args.listen)):
            return sup.outcome()
        if not args.no_demo and not await sup.until_stopped(demo(args.listen, args.prompt)):
            return sup.outcome()
        print(ready_message(args), flush=True)
        await asyncio.wait([sup.stopped, *sup.exits.values()], return_when=asyncio.FIRST_COMPLETED)
        return sup.outcome()
    finally:
        await sup.shut_down()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signals: list[int] = []
    # Until the event loop takes over, a stop signal is only noted: the services are started whole (never half
    # started and lost to an exception), and the supervisor stops them at once.
    previous = {sig: signal.signal(sig, lambda signum, frame: signals.append(signum)) for sig in STOP_SIGNALS}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    preexec = die_with_parent()
    try:
        for name, command in service_commands(args).items():
            if signals:
                break
            procs[name] = subprocess.Popen(command, preexec_fn=preexec)
        return asyncio.run(supervise(args, procs, signals))
    finally:
        for p in procs.values():  # only when something failed before the supervisor stopped them
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
