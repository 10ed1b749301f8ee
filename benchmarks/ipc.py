"""The engine core <-> front-end transport, measured: one step's batch of N one-token deltas sent to another
process, decoded there, and a small reply sent back (the round trip of one step's routing).

    python benchmarks/ipc.py [--deltas 256,1024] [--iters 300]

Candidates (the same content each way):
- zmq+msgspec: ZeroMQ DEALER/ROUTER over ipc://, msgpack via msgspec Structs
  (scheduler_service/messages.py; vLLM's choice);
- grpc+protobuf: a gRPC bidi stream over a unix:// socket, the deltas as protobuf columns (the Execute stream's
  SampledTokens message, the cheapest protobuf form this project has);
- pipe+pickle: multiprocessing.Pipe with pickled RequestDelta dataclasses.
Prints the median round trip and the per-delta cost, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time

from client.bench.record import emit, machine


def deltas(n: int) -> list[object]:
    from scheduler_service.core.outputs import RequestDelta

    return [RequestDelta(f"{i:032x}", [1000 + i % 50]) for i in range(n)]


# ---- zmq + msgspec ---------------------------------------------------------------------------

def zmq_peer(address: str) -> None:
    import zmq

    from scheduler_service.messages import ToCore, encoder, to_frontend_decoder

    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    sock.send(encoder.encode(ToCore(hello=True)))
    ack = encoder.encode(ToCore())
    while True:
        msg = to_frontend_decoder.decode(sock.recv(copy=False))  # type: ignore[arg-type]
        if not msg.deltas:
            return
        sock.send(ack)


def zmq_rounds(n: int, iters: int) -> list[float]:
    import zmq

    from scheduler_service.messages import ToFrontend, delta_to_wire, encoder, ipc_address, to_core_decoder

    address = ipc_address("bench")
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(address)
    peer = multiprocessing.get_context("spawn").Process(target=zmq_peer, args=(address,))
    peer.start()
    identity, _ = sock.recv_multipart()
    batch = deltas(n)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        sock.send_multipart([identity, encoder.encode(ToFrontend([delta_to_wire(d) for d in batch]))])  # type: ignore[arg-type]
        to_core_decoder.decode(sock.recv_multipart()[1])
        times.append(time.perf_counter() - t)
    sock.send_multipart([identity, encoder.encode(ToFrontend())])
    peer.join()
    return times


# ---- grpc + protobuf columns -----------------------------------------------------------------

def grpc_peer(path: str) -> None:
    import grpc

    from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc

    class Echo(executor_pb2_grpc.ExecutorServicer):
        async def Execute(self, it, context):
            async for msg in it:
                yield executor_pb2.StepResult(step_id=msg.step_id)

    async def main() -> None:
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(Echo(), server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def grpc_rounds(n: int, iters: int) -> list[float]:
    import grpc

    from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc

    path = os.path.join(tempfile.gettempdir(), f"pagedserve-bench-{os.getpid()}.sock")
    peer = multiprocessing.get_context("spawn").Process(target=grpc_peer, args=(path,))
    peer.start()
    batch = deltas(n)

    async def main() -> list[float]:
        async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
            await asyncio.wait_for(ch.channel_ready(), 30)
            call = executor_pb2_grpc.ExecutorStub(ch).Execute()
            times = []
            for i in range(iters):
                t = time.perf_counter()
                # the deltas as columns, as the executor's SampledTokens carry tokens
                msg = executor_pb2.StepRequest(step_id=i)
                msg.running.request_ids.extend(d.request_id for d in batch)  # type: ignore[attr-defined]
                msg.running.num_scheduled_tokens.extend(d.new_token_ids[0] for d in batch)  # type: ignore[attr-defined]
                await call.write(msg)
                await call.read()
                times.append(time.perf_counter() - t)
            call.cancel()
            return times

    try:
        return asyncio.run(main())
    finally:
        peer.kill()
        peer.join()


# ---- pipe + pickle ---------------------------------------------------------------------------

def pipe_peer(conn: object) -> None:
    while True:
        msg = conn.recv()  # type: ignore[attr-defined]
        if not msg:
            return
        conn.send(b"ok")  # type: ignore[attr-defined]


def pipe_rounds(n: int, iters: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=pipe_peer, args=(there,))
    peer.start()
    batch = deltas(n)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        here.send(batch)
        here.recv()
        times.append(time.perf_counter() - t)
    here.send([])
    peer.join()
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deltas", default="256,1024")
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args(argv)
    emit({"bench": "ipc", "machine": machine()})
    rows = []
    for n in (int(x) for x in args.deltas.split(",")):
        for name, fn in (("zmq+msgspec", zmq_rounds), ("grpc+protobuf", grpc_rounds), ("pipe+pickle", pipe_rounds)):
            times = fn(n, args.iters)[args.iters // 10:]
            med = statistics.median(times)
            rec = {"bench": "ipc", "transport": name, "deltas": n, "round_trip_p50_us": round(med * 1e6),
                   "us_per_delta": round(med * 1e6 / n, 3)}
            emit(rec)
            rows.append(rec)
    print("| deltas per step | transport | round trip p50 (us) | us per delta |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['deltas']} | {r['transport']} | {r['round_trip_p50_us']} | {r['us_per_delta']} |")
    emit({"bench": "ipc", "machine_after": machine()})


if __name__ == "__main__":
    main()
