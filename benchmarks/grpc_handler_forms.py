"""What the form of a server-streaming gRPC handler costs per call, measured in one process (grpc.aio on uvloop).

    python benchmarks/grpc_handler_forms.py [--calls 2000] [--rounds 8] [--stream 512]

GenerationServicer.Generate, stripped of everything but how it hands its responses to gRPC, in three forms, each on
a server of its own in this process: `yield` (an async generator: gRPC writes what it yields; the handler before
--grpc-write-timeout), `write` (a coroutine that awaits context.write for each response) and `write+watch` (the
current handler: context.write inside contextlib.aclosing, noting each write's start and end for the call's
WriteWatch, a timer per call that cancels a call whose write waited --grpc-write-timeout). A client in the same loop
makes `--calls` sequential calls of 1-4 responses to each server in turn, interleaved over `--rounds` rounds (the
order alternating), then one call of `--stream` responses. Printed: wall and process CPU microseconds per call and
per streamed response (medians over rounds), and the ratios to `yield`. The full service's per-request figures,
A/B across commits, are benchmarks/grpc_per_request.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import AsyncIterator

import grpc
import uvloop

from client.bench.record import emit, machine
from protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from scheduler_service.frontend.generation import WriteWatch

WRITE_TIMEOUT_S = 30.0


async def responses(request: generation_pb2.GenerateRequest) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """request.sampling.max_tokens responses of one token each, the last one with a finish reason."""
    count = request.sampling.max_tokens
    for i in range(count):
        yield generation_pb2.GenerateResponse(request_id="r", token_ids=[65 + i % 20], text="x",
                                              finish_reason=generation_pb2.FINISH_REASON_LENGTH if i == count - 1
                                              else generation_pb2.FINISH_REASON_UNSPECIFIED)


class Yielding(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        async for response in responses(request):
            yield response


class Writing(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        async for response in responses(request):
            await context.write(response)


class WritingWatched(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        watch = WriteWatch(WRITE_TIMEOUT_S)
        try:
            async with contextlib.aclosing(responses(request)) as stream:  # type: ignore[type-var]
                async for response in stream:
                    watch.since = watch.loop.time()
                    await context.write(response)
                    watch.since = None
        finally:
            watch.close()


FORMS: dict[str, type[generation_pb2_grpc.GenerationServicer]] = {
    "yield": Yielding, "write": Writing, "write+watch": WritingWatched}


async def start(form: str) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(FORMS[form](), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def request(max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_token_ids=[65] * 4,
                                          sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


async def calls(stub: generation_pb2_grpc.GenerationStub, n: int, max_tokens: int | None = None) -> int:
    got = 0
    for i in range(n):
        async for _ in stub.Generate(request(max_tokens or 1 + i % 4)):
            got += 1
    return got


async def timed(stub: generation_pb2_grpc.GenerationStub, n: int, max_tokens: int | None = None
                ) -> tuple[float, float]:
    """Wall and CPU seconds of n sequential calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    await calls(stub, n, max_tokens)
    return time.perf_counter() - wall, time.process_time() - cpu


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    servers = {form: await start(form) for form in FORMS}
    channels = {form: grpc.aio.insecure_channel(address) for form, (_, address) in servers.items()}
    stubs = {form: generation_pb2_grpc.GenerationStub(channel) for form, channel in channels.items()}
    figures: dict[str, list[dict[str, float]]] = {form: [] for form in FORMS}
    try:
        for stub in stubs.values():
            await calls(stub, 200)
        for r in range(args.rounds):
            for form in (list(FORMS) if r % 2 == 0 else list(FORMS)[::-1]):
                wall, cpu = await timed(stubs[form], args.calls)
                s_wall, s_cpu = await timed(stubs[form], 1, args.stream)
                figures[form].append({"call_us": wall / args.calls * 1e6, "call_cpu_us": cpu / args.calls * 1e6,
                                      "stream_us": s_wall / args.stream * 1e6,
                                      "stream_cpu_us": s_cpu / args.stream * 1e6})
    finally:
        for channel in channels.values():
            await channel.close()
        for server, _ in servers.values():
            await server.stop(None)
    return {form: {k: statistics.median(f[k] for f in runs) for k in runs[0]} for form, runs in figures.items()}


def report(medians: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    first = medians["yield"]
    print(f"{'form':<12} {'us/call':>8} {'CPU us/call':>12} {'us/streamed':>12} {'CPU us/streamed':>16}"
          "   ratios to yield")
    for form, m in medians.items():
        ratios = " ".join(f"{m[k] / first[k]:.3f}" for k in m)
        print(f"{form:<12} {m['call_us']:>8.1f} {m['call_cpu_us']:>12.1f} {m['stream_us']:>12.1f} "
              f"{m['stream_cpu_us']:>16.1f}   {ratios}")
    emit({"benchmark": "grpc_handler_forms", "calls": args.calls, "rounds": args.rounds, "stream": args.stream,
          "medians": medians, "machine": machine()}, args.json_out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="sequential calls per round and form")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--stream", type=int, default=512, help="responses of the streamed call")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    report(uvloop.run(run(args)), args)


if __name__ == "__main__":
    main()
