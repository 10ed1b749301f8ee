"""The client CLI explains itself: every flag of generate, bench and health has a help line."""

from __future__ import annotations

import argparse
import json

import pytest

from client.commands import SAMPLING_ARGS, build_parser, response_json
from client.lib import build_request
from protos.pagedserve.v1 import generation_pb2


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


def test_generate_sends_include_stop_str_in_output_and_json_shows_the_stop_reason() -> None:
    args = build_parser().parse_args(["generate", "--include-stop-str-in-output", "--stop-token-ids", "7", "hi"])
    sampling = {k: getattr(args, k) for k in SAMPLING_ARGS if getattr(args, k) is not None}
    request = build_request(args.prompt, **sampling)
    assert request.sampling.include_stop_str_in_output and list(request.sampling.stop_token_ids) == [7]
    last = generation_pb2.GenerateResponse(token_ids=[7], finish_reason=generation_pb2.FINISH_REASON_STOP,
                                           stop_token_id=7)
    assert json.loads(response_json(last))["stop_reason"] == 7
    assert "stop_reason" not in json.loads(response_json(generation_pb2.GenerateResponse(token_ids=[5])))


def test_generate_sends_prompt_logprobs_and_json_shows_them() -> None:
    args = build_parser().parse_args(["generate", "--prompt-logprobs", "2", "hi"])
    sampling = {k: getattr(args, k) for k in SAMPLING_ARGS if getattr(args, k) is not None}
    assert build_request(args.prompt, **sampling).sampling.prompt_logprobs == 2
    first = generation_pb2.GenerateResponse(token_ids=[5])
    first.prompt_logprobs.add(token_id=9, logprob=-1.5).top.add(token_id=9, logprob=-1.5)
    assert json.loads(response_json(first))["prompt_logprobs"] == [
        {"token_id": 9, "logprob": -1.5, "top": [[9, -1.5]]}]
