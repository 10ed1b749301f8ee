"""The OpenAI HTTP port attacked (#27): slowloris connections, a huge chat message, and client mistakes that used
to be 500s with a traceback.

- Slow connections: a request's headers must arrive within --http-header-timeout of its first byte, its body
  within --http-body-timeout, an idle connection is closed after --http-timeout-keep-alive, and an api server
  holds at most --http-max-connections (at most half its open-file limit, which it raises to the hard limit at
  start). The scheduler runs here with the common soft limit of a few hundred descriptors, where 2,000 slow
  connections used to take every descriptor and so every new gRPC and HTTP request of the process.
- A chat conversation is bounded in bytes before it is rendered, and rendered and tokenized off the event loop.
- The hostile set: every client mistake is a 4xx OpenAI error naming the field, never a 500 or a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from client.lib import PagedServeClient
from client.port_file import wait_ports
from executor_service.default_model.model import train_tokenizer
from tests.support.procs import (
    ROOT,
    Stack,
    loopback,
    run,
    run_script,
    running_http_stack,
    start_listening,
    stop,
    wait_healthy,
    wait_until,
)

KEY = "test-key-27"
HEADER_TIMEOUT = 1.5
BODY_TIMEOUT = 3.0
KEEP_ALIVE = 8.0
SLACK = 3.5  # this test's own event loop on a loaded 2-core machine: when it sees a close, not when it happened
SOFT_FILES, HARD_FILES = 100, 256  # the scheduler starts with these open-file limits: at most 128 HTTP connections
CAP = HARD_FILES // 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] + m.get('suffix', '') }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass
class HttpStack:
    grpc_address: str
    http_port: int
    executor: subprocess.Popen[bytes]
    scheduler: subprocess.Popen[bytes]
    log_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return (self.log_dir / "scheduler.log").read_text()

    def api_server_files(self) -> int:
        """Open file descriptors of the (one) api server process."""
        pid = re.search(r"api server 0 \(pid (\d+)\) serving", self.log())
        assert pid is not None
        return len(os.listdir(f"/proc/{pid.group(1)}/fd"))


def start_scheduler(args: list[str], log: Path, files: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
    """python -m scheduler_service ARGS, optionally started with (soft, hard) open-file limits."""

    def limit_files() -> None:
        if files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, files)

    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "scheduler_service", *args], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, preexec_fn=limit_files,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@contextlib.contextmanager
def http_stack(log_dir: Path, executor_args: list[str], scheduler_args: list[str],
               files: tuple[int, int] | None = None) -> Iterator[HttpStack]:
    executor, ex_ports = start_listening("executor_service", ["--simulated", *executor_args], log_dir / "executor.log")
    ex_address, port_file = loopback(ex_ports["listen"]), log_dir / "scheduler.ports"
    scheduler = start_scheduler(["--listen", "127.0.0.1:0", "--port-file", str(port_file), "--executor", ex_address,
                                 "--metrics-port", "-1", "--http-listen", "127.0.0.1:0", "--api-server-count", "1",
                                 *scheduler_args], log_dir / "scheduler.log", files)
    try:
        ports = wait_ports(port_file, ("listen", "http_listen"), scheduler)
        stack = HttpStack(loopback(ports["listen"]), ports["http_listen"], executor, scheduler, log_dir)
        wait_healthy(ex_address, executor)
        wait_healthy(stack.grpc_address, scheduler)
        wait_until(lambda: "OpenAI-compatible HTTP API on" in stack.log(), timeout=30, what="the HTTP API")
        yield stack
    finally:
        stop(scheduler)
        stop(executor)


# ---- slow connections ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    args = ["--http-header-timeout", str(HEADER_TIMEOUT), "--http-body-timeout", str(BODY_TIMEOUT),
            "--http-timeout-keep-alive", str(KEEP_ALIVE)]
    with http_stack(tmp_path_factory.mktemp("slow"), ["--sim-step-latency-ms", "2"], args,
                    (SOFT_FILES, HARD_FILES)) as stack:
        yield stack


@dataclass
class Slow:
    """One attacking connection: its bytes trickle in, and `closed` is when the server closed it."""

    opened: float
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    closed: float | None = None
    answer: bytes = b""


async def open_slow(port: int, head: bytes) -> Slow | None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    slow = Slow(time.monotonic(), reader, writer)
    with contextlib.suppress(OSError, RuntimeError):
        writer.write(head)
    return slow


async def watch_close(slow: Slow) -> None:
    """Note what the server answers and when it closes the connection."""
    with contextlib.suppress(OSError):
        slow.answer = await slow.reader.read()
    slow.closed = time.monotonic()


async def trickle(slow: Slow, drip: bytes, every: float) -> None:
    """Send one byte of `drip` every `every` seconds (forever), and note when the server closes."""
    watcher = asyncio.create_task(watch_close(slow))
    try:
        for byte in itertools.cycle(drip):
            if watcher.done():
                break
            with contextlib.suppress(OSError, RuntimeError):  # (closed under us)
                slow.writer.write(bytes([byte]))
            await asyncio.wait([watcher], timeout=every)
    finally:
        watcher.cancel()
        slow.writer.close()


async def completion(stack: HttpStack, **body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session, \
            session.post(f"{stack.url}/v1/completions", json={"max_tokens": 4, **body}) as r:
        return r.status, await r.json()


async def grpc_generate(stack: HttpStack) -> int:
    """Tokens of one Generate over a new channel (a new connection to the api server)."""
    async with PagedServeClient(stack.grpc_address) as client:
        ids, _, _, error = await asyncio.wait_for(run(client, prompt_token_ids=[65] * 4, max_tokens=4), 20)
        assert not error
        return len(ids)


def test_the_process_raised_its_open_file_limit_and_capped_the_http_port(slow_stack: HttpStack) -> None:
    log = slow_stack.log()
    assert f"open-file limit raised from {SOFT_FILES} to {HARD_FILES} (the hard limit)" in log
    assert f"--http-max-connections 4096 lowered to {CAP}" in log
    assert f"at most {CAP} connections, headers within {HEADER_TIMEOUT:g}s" in log


async def test_slow_headers_are_closed_and_grpc_and_http_keep_serving(slow_stack: HttpStack) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    attackers = [s for s in await asyncio.gather(*(open_slow(slow_stack.http_port, head) for _ in range(3 * CAP)))
                 if s is not None]
    drips = [asyncio.create_task(trickle(s, b"X-Slow: 1\r\n", 0.3)) for s in attackers]
    try:
        # meanwhile: a new gRPC connection and a new HTTP connection are served
        assert await grpc_generate(slow_stack) == 4
        status, body = await completion(slow_stack, prompt="hello")
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        await asyncio.wait_for(asyncio.gather(*drips), HEADER_TIMEOUT + 5)
    finally:
        for task in drips:
            task.cancel()
    late = [s.closed - s.opened for s in attackers if s.closed is not None]
    assert len(late) == len(attackers) and max(late) < HEADER_TIMEOUT + SLACK, "every slow connection closed in time"
    assert max(late) < KEEP_ALIVE, "closed by the header timeout, not the keep-alive timeout"


@pytest.fixture(scope="module")
def capped_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    """The open-file limits of slow_stack (so the cap of CAP connections), and no header timeout within a test."""
    with http_stack(tmp_path_factory.mktemp("capped"), [], ["--http-header-timeout", "3600"],
                    (SOFT_FILES, HARD_FILES)) as stack:
        yield stack


async def test_at_the_cap_the_longest_waiting_connections_make_room(capped_stack: HttpStack) -> None:
    """3 * CAP slow senders, none timed out (the header timeout is an hour): the api server closes all but CAP of
    them to make room, and a new connection is still served by closing exactly one more, so the server held
    exactly CAP (counted by what the clients see: the process's descriptor count also moves with its own work)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    attackers = [s for s in await asyncio.gather(*(open_slow(capped_stack.http_port, head) for _ in range(3 * CAP)))
                 if s is not None]
    watchers = [asyncio.create_task(watch_close(s)) for s in attackers]
    try:
        await wait_async(lambda: sum(s.closed is not None for s in attackers) == len(attackers) - CAP,
                         f"all but {CAP} of {len(attackers)} connections closed")
        status, body = await completion(capped_stack, prompt="hello")
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        await wait_async(lambda: sum(s.closed is not None for s in attackers) == len(attackers) - CAP + 1,
                         "the longest-waiting one closed for the new connection")
    finally:
        for task, slow in zip(watchers, attackers, strict=True):
            task.cancel()
            slow.writer.close()


async def wait_async(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll predicate on this event loop (the connections' watchers run meanwhile) until true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_past_the_cap_of_busy_connections_new_ones_are_refused(slow_stack: HttpStack) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    holders = [s for s in await asyncio.gather(*(open_slow(slow_stack.http_port, head) for _ in range(CAP)))
               if s is not None]
    drips = [asyncio.create_task(trickle(s, b" ", 0.3)) for s in holders]
    try:
        await asyncio.sleep(0.5)
        assert all(s.closed is None for s in holders), "connections serving a request are never evicted"
        refused = await open_slow(slow_stack.http_port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert refused is not None
        answer = await asyncio.wait_for(refused.reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"--http-max-connections" in answer
        assert await grpc_generate(slow_stack) == 4
        await asyncio.wait_for(asyncio.gather(*drips), BODY_TIMEOUT + 5)
    finally:
        for task in drips:
            task.cancel()
    late = [s.closed - s.opened for s in holders if s.closed is not None]
    assert len(late) == len(holders) and max(late) < BODY_TIMEOUT + SLACK
    answers = {s.answer.split(b"\r\n", 1)[0] for s in holders}
    assert answers == {b"HTTP/1.1 408 Request Timeout"}, answers
    error = json.loads(holders[0].answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "invalid_request_error" and "--http-body-timeout" in error["message"]
    status, _ = await completion(slow_stack, prompt="hello")
    assert status == 200


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(slow_stack: HttpStack) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", slow_stack.http_port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answered = time.monotonic()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length:"))
        await reader.readexactly(length)
        assert await asyncio.wait_for(reader.read(), KEEP_ALIVE + 5) == b""
        assert KEEP_ALIVE - 1 < time.monotonic() - answered < KEEP_ALIVE + SLACK
    finally:
        writer.close()


def test_no_traceback_after_the_slow_clients(slow_stack: HttpStack) -> None:
    wait_until(lambda: "closed" in slow_stack.log() and "HTTP port, last 10 s" in slow_stack.log(), timeout=30,
               what="the report of closed connections")
    log = slow_stack.log()
    assert "Traceback" not in log and " ERROR " not in log


# ---- a client that stops reading ------------------------------------------------------------------------------

WRITE_TIMEOUT = 1.0
STALLED_TOKENS = 50_000  # ~100 s of 2 ms steps: run to its end, it would outlast the test's wait many times over


@pytest.fixture(scope="module")
def stalled_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """--http-write-timeout 1 s and an 8 KiB send buffer; --max-stream-buffer so large that nothing but the write
    timeout can end a stream whose client stopped reading (the request's tokens are far fewer)."""
    executor = ["--simulated", "--sim-max-model-len", "100000", "--sim-step-latency-ms", "2"]
    scheduler = ["--http-write-timeout", str(WRITE_TIMEOUT), "--http-send-buffer", "8192",
                 "--max-stream-buffer", "1000000", "--api-server-count", "1"]
    with running_http_stack(tmp_path_factory.mktemp("stalled"), executor, scheduler) as stack:
        yield stack


def stalled_stream(port: int) -> socket.socket:
    """A streamed completion sent on a connection whose receive buffer is small and which is never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it offers stays small
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": [65, 66, 67], "max_tokens": STALLED_TOKENS, "ignore_eos": True,
                       "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """What the connection delivers until the server ends it (a reset counts as its end)."""
    sock.settimeout(30)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data


def test_a_client_that_stops_reading_has_its_request_aborted_and_its_connection_dropped(
        stalled_stack: Stack) -> None:
    """The client never reads: its send buffer fills, its writes wait, and after --http-write-timeout the server
    drops the connection and aborts the request, its blocks freed. Another client is served meanwhile (sent at
    once: a wait for the stalled request to show as running could outlast the 1 s timeout on a loaded box). Before,
    aiohttp had no write timeout: the request ran its 50,000 tokens into buffers and the connection stayed open
    after, the handler waiting for a drain that never came."""
    stack = stalled_stack
    aborted = stack.metrics().get("vllm:request_success_total{abort}", 0)
    sock = stalled_stream(stack.ports["http_listen"])
    try:
        other = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
        answer = urllib.request.urlopen(urllib.request.Request(
            f"{stack.http_url}/v1/completions", other, {"Content-Type": "application/json"}), timeout=30)
        assert json.loads(answer.read())["choices"][0]["finish_reason"] == "length"
        wait_until(lambda: stack.metrics().get("vllm:request_success_total{abort}", 0) == aborted + 1
                   and stack.idle(), timeout=60, what="the stalled request aborted and its blocks freed")
        data = read_to_end(sock)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 200") and b"data: {" in data, data[:200]
    assert b"[DONE]" not in data  # dropped mid-stream, not ended


# ---- chat input and the hostile set -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    log_dir = tmp_path_factory.mktemp("chat")
    tokenizer_dir = log_dir / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text(train_tokenizer().to_str())
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    executor = ["--sim-vocab-size", "2048", "--sim-max-model-len", "100000", "--sim-step-latency-ms", "5"]
    with http_stack(log_dir, executor, ["--tokenizer", str(tokenizer_dir), "--api-key", KEY]) as stack:
        yield stack


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        yield s


async def post_raw(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


async def test_a_huge_chat_message_is_refused_quickly_while_another_stream_flows(chat_stack: HttpStack) -> None:
    async with PagedServeClient(chat_stack.grpc_address, api_key=KEY) as client:
        canary = client.generate(prompt_token_ids=[65] * 4, max_tokens=20_000, ignore_eos=True)
        await anext(canary)
        arrivals: list[float] = []
        done = asyncio.Event()

        async def watch() -> None:
            async for _ in canary:
                arrivals.append(time.monotonic())
                if done.is_set():
                    break

        watcher = asyncio.create_task(watch())
        out = await run_script(CHAT_ATTACK, chat_stack.url, KEY)
        await asyncio.sleep(0.2)
        done.set()
        await watcher
        await canary.aclose()
    results = [json.loads(line) for line in out.decode().splitlines()]
    huge, large, small = results
    assert huge["status"] == 400 and huge["param"] == "messages" and "bytes of text is more than" in huge["message"]
    assert huge["seconds"] < 5, "refused before rendering"
    assert large["status"] == 400 and large["param"] == "messages", large  # rendered, tokenized: too many tokens
    assert "tokens; max_model_len is 100000" in large["message"]
    assert small["status"] == 200, small
    # The 1.3 MB conversation takes the server large["seconds"] to render and tokenize (1.3 - 1.8 s on a quiet 2-core
    # box, twice that beside another test process); done on the event loop, it would stall the canary about that long.
    # What the loop does itself (reading and parsing the 50 MB body: ~0.4 s quiet) scales with the box's load alike.
    stall_bound = max(1.0, 0.6 * large["seconds"])
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < stall_bound, f"the canary stream stalled for {max(gaps):.2f}s (bound {stall_bound:.2f}s)"


CHAT_ATTACK = """
import json, sys, time
import urllib.request

url, key = sys.argv[1], sys.argv[2]
text = "the quick brown fox \\u65e5\\u672c\\u8a9e jumps over the lazy dog; "

def chat(content):
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1},
                      ensure_ascii=False).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": "Bearer " + key})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            status, answer = r.status, {}
    except urllib.error.HTTPError as e:
        status, answer = e.code, json.loads(e.read())["error"]
    print(json.dumps({"status": status, "param": answer.get("param"), "message": answer.get("message", ""),
                      "seconds": time.monotonic() - started}), flush=True)

chat(text * ((50 << 20) // len(text.encode())))   # 50 MB: more than max_model_len tokens can hold
chat(text * ((1300 << 10) // len(text.encode())))  # 1.3 MB: within the byte bound, too many tokens
chat("hello")
"""


HOSTILE: list[tuple[str, str, bytes, int, str | None]] = [
    ("nested 100,000 deep", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("nested in a field", "/v1/completions",
     b'{"prompt": "a", "stop": ' + b"[" * 500 + b"]" * 500 + b"}", 400, "stop"),
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', 400, "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt"),
    ("lone surrogate in a chat message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400, "messages"),
    ("lone surrogate in a field name", "/v1/completions", b'{"prompt": "a", "\\ud800": 1}', 400, None),
    ("chat_template_kwargs replacing messages", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}', 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs replacing bos_token", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"bos_token": "x"}}', 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs replacing raise_exception", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"raise_exception": 1}}', 400,
     "chat_template_kwargs"),
    ("a message the template fails on", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi", "suffix": 1}]}', 400, "messages"),
    ("a number of 5,000 digits", "/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400,
     None),
    ("NaN temperature", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    # an assistant's earlier tool calls, malformed, beside tools (a 500 from the tool-call rendering before)
    *((f"tool_calls {calls.decode()}", "/v1/chat/completions",
       b'{"messages": [{"role": "assistant", "tool_calls": ' + calls + b'}, {"role": "user", "content": "hi"}], '
       b'"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none", "max_tokens": 1}',
       400, "messages")
      for calls in (b'[{"id": "c", "type": "function", "function": "f"}]', b'"abc"', b"[5]",
                    b'[{"function": {"name": "f", "arguments": 7}}]', b'[{"function": {"arguments": "{}"}}]')),
    # a tool message must answer a tool call of the assistant message before it (rendered as it came before)
    *((f"tool message {what}", "/v1/chat/completions",
       b'{"messages": [{"role": "user", "content": "hi"}, ' + history + b'], "max_tokens": 1}', 400, "messages")
      for what, history in (
          ("without a call before it", b'{"role": "tool", "tool_call_id": "c1", "content": "x"}'),
          ("with an unknown id", b'{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
                                 b'"function": {"name": "f", "arguments": "{}"}}]}, '
                                 b'{"role": "tool", "tool_call_id": "c9", "content": "x"}'),
          ("without an id", b'{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
                            b'"function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "x"}'))),
]


@pytest.mark.parametrize(("what", "path", "body", "status", "param"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_the_hostile_set_gets_4xx_naming_the_field(chat_stack: HttpStack, session: aiohttp.ClientSession,
                                                          what: str, path: str, body: bytes, status: int,
                                                          param: str | None) -> None:
    got, answer = await post_raw(session, chat_stack.url + path, body)
    assert got == status, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if param is not None:
        assert error["message"].startswith(f"{param}: ") or param in error["message"], error


async def test_an_oversized_body_is_413_invalid_request_error(chat_stack: HttpStack,
                                                              session: aiohttp.ClientSession) -> None:
    body = b'{"prompt": "' + b"x" * (64 << 20) + b'"}'
    status, answer = await post_raw(session, chat_stack.url + "/v1/completions", body)
    assert status == 413
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"] == f"the request body is larger than {64 << 20} bytes"


async def test_huge_chat_template_kwargs_are_refused_naming_them(chat_stack: HttpStack,
                                                                 session: aiohttp.ClientSession) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                       "chat_template_kwargs": {"notes": "a" * (40 << 20)}}).encode()
    status, answer = await post_raw(session, chat_stack.url + "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "chat_template_kwargs", answer


async def raw_exchange(port: int, head: bytes, body: bytes, wait: float) -> bytes:
    """Send a request's head and (part of) a body on a raw connection; what the server answers within `wait`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        answer_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
        length = re.search(rb"Content-Length: (\d+)", answer_head, re.IGNORECASE)
        assert length is not None, answer_head
        return answer_head + await asyncio.wait_for(reader.readexactly(int(length.group(1))), wait)
    finally:
        writer.close()


async def test_a_declared_length_past_the_limit_is_413_before_the_body(chat_stack: HttpStack) -> None:
    """Content-Length over the limit is refused from the headers: not after the body timeout (60 s here), and
    without reading 64 MiB first."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {1 << 30}\r\n\r\n").encode()
    answer = await raw_exchange(chat_stack.http_port, head, b'{"prompt": "', wait=10)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"


async def test_a_compressed_body_is_415_from_its_headers_and_never_inflated(chat_stack: HttpStack) -> None:
    """A gzip body (here the first half of one: a bomb's rest never needs sending) is refused from its headers
    with a 415 naming Content-Encoding, and the connection ends. aiohttp used to inflate such bodies on the event
    loop as they arrived, up to the 64 MiB limit each: ~4.5 s of loop time per 500 MB of bombs, stalling every
    other client's stream. With nothing inflated, that cost is gone by construction."""
    body = gzip.compress(b'{"prompt": "' + b"a" * (8 << 20) + b'", "max_tokens": 1}', 1)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", chat_stack.http_port)
    try:
        writer.write(head + body[:len(body) // 2])
        answer = await asyncio.wait_for(reader.read(), 30)  # the whole answer, to the server's end of the stream
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 415"), answer[:200]  # (not the body timeout's 408: nothing waited for it)
    assert b"Connection: close" in answer
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "Content-Encoding 'gzip'" in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP", "x-unknown"])
async def test_every_request_content_encoding_but_identity_is_415(
        chat_stack: HttpStack, session: aiohttp.ClientSession, encoding: str) -> None:
    """Whole, valid gzip bodies too (they were served before): no encoding is ever inflated."""
    body = gzip.compress(json.dumps({"prompt": "hello", "max_tokens": 1}).encode())
    async with session.post(chat_stack.url + "/v1/completions", data=body,
                            headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as r:
        answer = await r.json(content_type=None)
    assert r.status == 415, answer
    assert "Content-Encoding" in answer["error"]["message"], answer


async def test_content_encoding_identity_is_served(chat_stack: HttpStack, session: aiohttp.ClientSession) -> None:
    async with session.post(chat_stack.url + "/v1/completions", data=json.dumps({"prompt": "hi", "max_tokens": 1}),
                            headers={"Content-Type": "application/json", "Content-Encoding": "identity"}) as r:
        answer = await r.json(content_type=None)
    assert r.status == 200, answer
    assert answer["usage"]["completion_tokens"] == 1, answer


async def test_connections_dropped_mid_body_leave_no_error_in_the_log(chat_stack: HttpStack) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    for _ in range(20):
        _, writer = await asyncio.open_connection("127.0.0.1", chat_stack.http_port)
        writer.write(head + b'{"prompt": "abc')
        await writer.drain()
        writer.transport.abort()
    status, _ = await completion(chat_stack, prompt="still serving")  # after the drops: they were handled
    assert status == 200
    assert " ERROR " not in chat_stack.log() and "Traceback" not in chat_stack.log()


@pytest.mark.parametrize(("headers", "status"), [
    ({"Content-Type": "application/json; charset=bogus"}, 415),
    ({"Content-Type": "application/json; charset=latin-1"}, 415),
], ids=["unknown-charset", "other-charset"])
async def test_a_body_that_cannot_be_read_as_utf8_json_is_4xx(chat_stack: HttpStack, session: aiohttp.ClientSession,
                                                               headers: dict[str, str], status: int) -> None:
    """JSON is UTF-8: another declared charset is a 415 (an unknown one was a 500, latin-1 garbled the prompt)."""
    async with session.post(chat_stack.url + "/v1/completions", data=b'{"prompt": "hi", "max_tokens": 2}',
                            headers=headers) as r:
        answer = await r.json(content_type=None)
    assert r.status == status, answer
    assert answer["error"]["type"] == "invalid_request_error", answer


async def test_a_non_ascii_authorization_header_is_401(chat_stack: HttpStack) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", chat_stack.http_port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\xffy\xe9\r\n"
                     b"Connection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 401")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_api_key"


def test_no_server_error_and_no_traceback_in_the_log(chat_stack: HttpStack) -> None:
    log = chat_stack.log()
    assert "Traceback" not in log and " ERROR " not in log
    assert "Error handling request" not in log


async def test_grpc_still_serves_after_the_hostile_set(chat_stack: HttpStack) -> None:
    async with PagedServeClient(chat_stack.grpc_address, api_key=KEY) as client:
        ids, _, _, error = await run(client, prompt_token_ids=[65] * 4, max_tokens=3)
    assert len(ids) == 3 and not error
    with pytest.raises(grpc.aio.AioRpcError):
        async with PagedServeClient(chat_stack.grpc_address) as client:  # no key
            await run(client, prompt_token_ids=[65] * 4, max_tokens=3)
