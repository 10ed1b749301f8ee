"""The client CLI explains itself: every flag of generate, bench and health has a help line."""

from __future__ import annotations

import argparse

import pytest

from client.commands import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", ["generate", "bench", "health"])
def test_every_flag_has_a_help_line(name: str) -> None:
    parser = subcommands()[name]
    missing = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
    assert missing == []
    assert len(parser._actions) > 3


def test_bench_backend_flags_parse() -> None:
    args = build_parser().parse_args(["bench", "--backend", "openai", "--base-url", "http://h:1", "--model", "m"])
    assert (args.backend, args.base_url, args.model) == ("openai", "http://h:1", "m")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--backend", "http"])
