"""`pagedserve`, the console script: one command for the services and the client, as `vllm serve` users expect.

    pagedserve serve [MODEL] ...            both services on this machine (scripts/up.sh runs this)
    pagedserve scheduler ARGS...            = python -m scheduler_service ARGS...
    pagedserve executor ARGS...             = python -m executor_service ARGS...
    pagedserve frontend ARGS...             = python -m scheduler_service.frontend ARGS...
    pagedserve generate|bench|health ...    = python -m client generate|bench|health ...

Everything after the command name goes to that command unchanged (`--help` included). Importing this module
stays light: a command imports what it runs (torch, the scheduler) only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PROG = "pagedserve"


def _serve(argv: list[str]) -> int:
    from client.serve import main
    return main(argv)


def _scheduler(argv: list[str]) -> int:
    from scheduler_service.launch import run
    return run(argv, prog=f"{PROG} scheduler")


def _frontend(argv: list[str]) -> int:
    from scheduler_service.frontend.frontend_process import run
    return run(argv, prog=f"{PROG} frontend")


def _executor(argv: list[str]) -> int:
    """Exactly `python -m executor_service ARGS...`, in this process: runpy runs the package's __main__ the way
    -m does (its quiet exit and, under tensor parallelism, its spawned ranks included)."""
    import runpy
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("executor_service", run_name="__main__", alter_sys=True)
    return 0


def _client(name: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from client.commands import main
        return main([name, *argv], prog=PROG)
    return run


@dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[list[str]], int]


COMMANDS: dict[str, Command] = {
    "serve": Command("run the executor and the scheduler on this machine (MODEL: a Hugging Face model "
                     "directory; default: the embedded model)", _serve),
    "scheduler": Command("run the scheduler service (= python -m scheduler_service)", _scheduler),
    "executor": Command("run the executor service (= python -m executor_service)", _executor),
    "frontend": Command("run a front-end of its own over engine cores (= python -m scheduler_service.frontend)",
                        _frontend),
    "generate": Command("stream one generation from a running server", _client("generate")),
    "bench": Command("benchmark a running server, measured the way vllm bench serve measures", _client("bench")),
    "health": Command("exit 0 when a server reports SERVING", _client("health")),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version
    try:
        return package_version("pagedserve")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The top level only, for --help, --version and errors: a command's own flags belong to its parser."""
    p = argparse.ArgumentParser(
        prog=PROG, description="pagedserve: an LLM inference server (scheduler and executor services over gRPC).",
        epilog=f"Each command explains its own flags: {PROG} COMMAND --help.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]].run(args[1:])
    parser = build_parser()
    if not args:
        parser.print_help(sys.stderr)
        return 2
    parser.parse_args(args)  # --help and --version exit here, and so does anything that is not a command
    parser.error(f"expected a command: {', '.join(COMMANDS)}")


if __name__ == "__main__":
    sys.exit(main())
