"""The client's commands, generate, bench and health: `python -m client COMMAND ...` and `pagedserve COMMAND ...`
(client/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import grpc

from client.bench.cli import add_bench_parser, run_bench
from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2

FINISH_NAMES = {
    generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort", generation_pb2.FINISH_REASON_ERROR: "error",
}


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="API key (default: $PAGEDSERVE_API_KEY)")
    p.add_argument("--tls", action="store_true", help="connect over TLS with the system CA roots")
    p.add_argument("--tls-ca", default=None, help="PEM CA to verify the server certificate")


def build_parser(prog: str = "python -m client") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="pagedserve client")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream one generation",
                       description="Stream one generation over gRPC; the text goes to stdout as it arrives.")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (or give --prompt-token-ids)")
    g.add_argument("--server", default="127.0.0.1:50051", help="scheduler HOST:PORT (default 127.0.0.1:50051)")
    g.add_argument("--prompt-token-ids", type=_ids, default=None, metavar="ID,ID,...",
                   help="the prompt as token ids instead of text")
    g.add_argument("--request-id", default="", help="request id (default: the server makes one)")
    g.add_argument("--max-tokens", type=int, help="most tokens to generate (server default 16)")
    g.add_argument("--min-tokens", type=int, help="generate at least this many before EOS or a stop string counts")
    g.add_argument("--temperature", type=float, help="0 = greedy; default 1.0")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]; default 1")
    g.add_argument("--top-k", type=int, help="sample from the k likeliest tokens; -1 or 0 = off")
    g.add_argument("--min-p", type=float, help="drop tokens below min_p x the top probability; default 0")
    g.add_argument("--seed", type=int, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string, not included in the output unless --include-stop-str-in-output (repeatable)")
    g.add_argument("--stop-token-ids", type=_ids, default=None, metavar="ID,ID,...",
                   help="token ids that end the generation")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past EOS to --max-tokens")
    g.add_argument("--include-stop-str-in-output", action="store_true", default=None,
                   help="keep the stop string or stop token that ended the text in it")
    g.add_argument("--presence-penalty", type=float, help="in [-2, 2]: penalise tokens already generated")
    g.add_argument("--frequency-penalty", type=float, help="in [-2, 2]: penalise tokens by how often they appeared")
    g.add_argument("--repetition-penalty", type=float, help="in (0, 2]; > 1 discourages repeating prompt or output")
    g.add_argument("--logprobs", type=int, help="return the logprob of each token and this many alternatives")
    g.add_argument("--prompt-logprobs", type=int,
                   help="return the logprob of each prompt token after the first and this many alternatives")
    g.add_argument("--n", type=int, help="number of sequences to generate for the prompt")
    g.add_argument("--priority", type=int, help="lower runs first under the scheduler's --policy priority")
    g.add_argument("--output-len-hint", type=int, help="expected output length, for the scheduler's --policy sjf")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds for the whole call")
    g.add_argument("--json", action="store_true", help="one JSON object per streamed response")
    g.add_argument("--resume-attempts", type=int, default=0,
                   help="resume a broken stream up to this many times in a row (any front-end behind --server), "
                        "from the tokens received; 0 = never")
    h = sub.add_parser("health", help="exit 0 when the server reports SERVING")
    add_connection_args(g)
    add_connection_args(h)
    h.add_argument("--server", default="127.0.0.1:50051", help="scheduler or executor HOST:PORT")
    h.add_argument("--service", default="", help="service name to check (default: the whole server)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    add_bench_parser(sub)
    return p


SAMPLING_ARGS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "n", "priority")


def response_json(r: generation_pb2.GenerateResponse) -> str:
    obj: dict[str, object] = {
        "request_id": r.request_id, "index": r.index, "token_ids": list(r.token_ids), "text": r.text,
        "finish_reason": FINISH_NAMES.get(r.finish_reason)}
    if r.error:
        obj["error"] = r.error
    which = r.WhichOneof("stop_reason")
    if which is not None:
        obj["stop_reason"] = getattr(r, which)
    if r.finish_reason:
        obj["usage"] = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens}
    for name in ("logprobs", "prompt_logprobs"):
        entries = getattr(r, name)
        if entries:
            obj[name] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                          "top": [[t.token_id, t.logprob] for t in lp.top]} for lp in entries]
    return json.dumps(obj, ensure_ascii=False)


def client_for(args: argparse.Namespace) -> PagedServeClient:
    return PagedServeClient(args.server, api_key=args.api_key, tls=args.tls, tls_ca=args.tls_ca,
                            resume_attempts=getattr(args, "resume_attempts", 0))


async def generate(args: argparse.Namespace) -> int:
    sampling = {k: getattr(args, k) for k in SAMPLING_ARGS if getattr(args, k) is not None}
    code = 0
    async with client_for(args) as client:
        try:
            async for r in client.generate(args.prompt, args.prompt_token_ids, request_id=args.request_id,
                                           output_len_hint=args.output_len_hint, timeout=args.timeout,
                                           **sampling):
                if args.json:
                    print(response_json(r), flush=True)
                else:
                    print(r.text, end="", flush=True)
                if r.finish_reason == generation_pb2.FINISH_REASON_ERROR:
                    print(f"\nerror: {r.error}", file=sys.stderr)
                    code = 1
        except grpc.aio.AioRpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if not args.json:
        print()
    return code


async def health(args: argparse.Namespace) -> int:
    async with client_for(args) as client:
        try:
            ok = await client.health(args.service, timeout=args.timeout)
        except grpc.aio.AioRpcError as e:
            print(f"unhealthy: {e.code().name}", file=sys.stderr)
            return 1
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


def main(argv: list[str] | None = None, prog: str = "python -m client") -> int:
    args = build_parser(prog).parse_args(argv)
    handler = {"generate": generate, "health": health, "bench": run_bench}[args.command]
    return asyncio.run(handler(args))

