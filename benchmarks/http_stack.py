"""Per-chunk and per-request cost of the two candidate HTTP stacks for the OpenAI API: aiohttp vs FastAPI on uvicorn.

Each stack serves the same two endpoints with no model behind them: an SSE stream of --chunks OpenAI-sized
chunks, and a small JSON POST. The server runs in its own process (uvloop); the client is aiohttp. The figure
that matters is the server's CPU time per streamed chunk (its added per-token cost), read from the server
process's own CPU clock, and the ratio between the stacks measured in the same run.

    python benchmarks/http_stack.py [--chunks 20000] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import socket
import time

CHUNK = json.dumps({"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}]})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve_aiohttp(port: int, chunks: int) -> None:
    import uvloop
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await response.write(f"data: {CHUNK}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def post(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"ok": True, "n": len(body)})

    async def cpu(request: web.Request) -> web.Response:
        return web.json_response({"cpu": cpu_seconds()})

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_post("/post", post)
    app.router.add_get("/cpu", cpu)
    uvloop.run(web._run_app(app, host="127.0.0.1", port=port, print=None, access_log=None))


def serve_fastapi(port: int, chunks: int) -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body():  # type: ignore[no-untyped-def]
            for _ in range(chunks):
                yield f"data: {CHUNK}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/post")
    async def post(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"ok": True, "n": len(body)})

    @app.get("/cpu")
    async def cpu() -> JSONResponse:
        return JSONResponse({"cpu": cpu_seconds()})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools" if has_httptools() else "h11")


def has_httptools() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


async def measure(port: int, requests: int) -> tuple[float, float, float]:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.get(f"{base}/cpu") as r:
                    start_cpu = (await r.json())["cpu"]
                break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        received = 0
        async with session.get(f"{base}/stream") as r:
            async for line in r.content:
                received += line.startswith(b"data: ")
        stream_wall = time.perf_counter() - t0
        async with session.get(f"{base}/cpu") as r:
            mid_cpu = (await r.json())["cpu"]
        for _ in range(requests):
            async with session.post(f"{base}/post", json={"prompt": "hello", "max_tokens": 16}) as r:
                await r.read()
        async with session.get(f"{base}/cpu") as r:
            end_cpu = (await r.json())["cpu"]
    return (mid_cpu - start_cpu) / max(received - 1, 1), stream_wall / max(received, 1), (end_cpu - mid_cpu) / requests


def run_stack(name: str, chunks: int, requests: int) -> tuple[float, float, float]:
    port = free_port()
    target = serve_aiohttp if name == "aiohttp" else serve_fastapi
    proc = mp.get_context("spawn").Process(target=target, args=(port, chunks), daemon=True)
    proc.start()
    try:
        return asyncio.run(measure(port, requests))
    finally:
        proc.terminate()
        proc.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=20000, help="SSE chunks streamed in one response")
    p.add_argument("--requests", type=int, default=2000, help="sequential small JSON POSTs")
    args = p.parse_args()
    results = {name: run_stack(name, args.chunks, args.requests) for name in ("aiohttp", "fastapi")}
    print(f"{'stack':<10}{'server CPU/chunk':>18}{'wall/chunk':>14}{'server CPU/POST':>18}")
    for name, (cpu_chunk, wall_chunk, cpu_post) in results.items():
        print(f"{name:<10}{cpu_chunk * 1e6:>15.1f} us{wall_chunk * 1e6:>11.1f} us{cpu_post * 1e6:>15.1f} us")
    a, f = results["aiohttp"], results["fastapi"]
    print(f"ratio fastapi/aiohttp: per chunk {f[0] / a[0]:.2f}x, per POST {f[2] / a[2]:.2f}x")


if __name__ == "__main__":
    main()
