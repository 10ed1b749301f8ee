"""The vocabulary both tiers of the scheduler service share: what the engine core and its api servers exchange
(one msgpack message per step each way, over a ZeroMQ DEALER (api server) / ROUTER (engine core) pair), the
refusals and errors either side raises, and the count of refused calls."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import re
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, Metric

from scheduler_service.core.logprobs import TokenLogprob
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request, SamplingOptions

log = logging.getLogger("pagedserve.scheduler")


class Refusal(enum.IntEnum):
    """Why the core did not take a request; the front-end maps it to a gRPC status."""

    QUEUE_FULL = 1
    DUPLICATE_ID = 2
    NOT_READY = 3


class QueueFull(Exception):
    pass


def settled_by_frontend(reason: FinishReason | None, stop_strings: bool) -> bool:
    """A LENGTH finish of a request whose stop strings the front-end matches: the front-end may answer it
    `stop` (the last allowed token completed one), so it is counted when the front-end settles it."""
    return stop_strings and reason is FinishReason.LENGTH


class NewRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float
    output_len_hint: int | None = None
    stop_strings: bool = False  # the front-end settles a LENGTH finish (ExecutorLoop.add)
    share_prompt_with: str | None = None  # the first sibling of an n > 1 request
    cache_salt: str | None = None  # vLLM's per-request prefix-cache salt
    tenant: str = ""  # the api server's keyed digest of the caller's API key (never the key), or ""
    output_token_ids: list[int] = []  # a resumed request: the tokens its client has already had (#28)
    resume: bool = False  # a continuation: it supersedes a request of the same id and tenant still in the core
    owner: str = ""  # the api server's keyed digest of the caller's API key, also with a shared prefix cache


class Ended(msgspec.Struct, array_like=True, gc=False):
    """A request the front-end ended: a cancelled call (ABORTED) or a stop string (STOPPED); or, for one
    added with stop_strings that the core finished LENGTH, how the front-end answered it (STOPPED or not)."""

    request_id: str
    reason: FinishReason


class ToCore(msgspec.Struct, array_like=True, gc=False):
    new: list[NewRequest] = []
    ended: list[Ended] = []
    hello: bool = False
    overflows: int = 0  # streams this api server aborted for --max-stream-buffer since its last message
    refused: dict[str, int] = {}  # calls it refused since its last message, by gRPC status code name
    frontend: bytes = b""  # with hello: the front-end's name; the core drops its earlier sessions' links (#28)
    sent_at: float = 0.0  # the front-end's time.monotonic() at sending: arrival times are moved into the core's clock


class Delta(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str = ""
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # TokenLogprob as (id, logprob, top)
    unavailable: bool = False  # ended because no executor came back within --executor-wait-timeout
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # once: prompt positions 1 ..
    invalid: bool = False  # an ERROR finish that is the request's fault (its constraint does not compile)


class Refused(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    why: Refusal
    message: str


class Status(msgspec.Struct, array_like=True, gc=False):
    ready: bool
    describe: bytes = b""
    unknown: bool = False  # the sender said no hello on this socket (the core restarted or dropped it): say hello


class ToFrontend(msgspec.Struct, array_like=True, gc=False):
    deltas: list[Delta] = []
    refused: list[Refused] = []
    status: Status | None = None


def request_from(msg: NewRequest, clock_offset: float = 0.0) -> Request:
    """clock_offset: the core's monotonic clock minus the sender's, so arrival times compare across hosts."""
    return Request(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.arrival_time + clock_offset,
                   output_len_hint=msg.output_len_hint, output_token_ids=list(msg.output_token_ids),
                   share_prompt_with=msg.share_prompt_with, cache_salt=msg.cache_salt, tenant=msg.tenant,
                   owner=msg.owner)


def new_request(request: Request, stop_strings: bool = False, resume: bool = False) -> NewRequest:
    return NewRequest(request.request_id, request.prompt_token_ids, request.sampling, request.arrival_time,
                      request.output_len_hint, stop_strings, request.share_prompt_with, request.cache_salt,
                      request.tenant, list(request.output_token_ids), resume or bool(request.output_token_ids),
                      request.owner)


def delta_to_wire(d: RequestDelta, unavailable: bool = False, invalid: bool = False) -> Delta:
    prompt = None if d.prompt_logprobs is None else logprobs_to_wire(d.prompt_logprobs)
    if not d.logprobs:
        return Delta(d.request_id, d.new_token_ids, d.finish_reason, d.error, [], unavailable, prompt, invalid)
    return Delta(d.request_id, d.new_token_ids, d.finish_reason, d.error, logprobs_to_wire(d.logprobs), unavailable,
                 prompt, invalid)


def logprobs_to_wire(logprobs: list[TokenLogprob]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(lp.token_id, lp.logprob, list(lp.top)) for lp in logprobs]


def ipc_address(name: str) -> str:
    """A fresh ipc:// endpoint in the temp directory, pagedserve-NAME-PID-RANDOM: the pid lets a later start tell
    a file left by a killed process from a live one (Unix socket paths are short: keep it so)."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'pagedserve-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}')}"


def remove_ipc_file(address: str) -> None:
    """Remove the socket file of an ipc:// endpoint this process bound (ZeroMQ leaves it behind on close)."""
    if address.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address.removeprefix("ipc://"))


IPC_FILE = re.compile(r"^pagedserve-[a-z]+-(?:(?P<pid>\d+)-[0-9a-f]{8}|[0-9a-f]{12})$")  # new names, older ones
OLD_IPC_FILE_MIN_AGE_S = 60.0  # a file named without its pid is taken for stale only when older than this


def clear_stale_ipc_files(directory: str | None = None) -> list[str]:
    """Remove the ipc socket files that pagedserve processes killed before they could clean up left in the temp
    directory: only sockets named as ipc_address names them, owned by this user, whose process is gone (its pid
    is not alive; a name without a pid: older than a minute) and on which nobody listens. The paths removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        match = IPC_FILE.match(name)
        path = os.path.join(directory, name)
        if match is None or not _stale_socket(path, match.group("pid")):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def _stale_socket(path: str, pid: str | None) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return False
    if pid is not None and _alive(int(pid)):
        return False
    if pid is None and time.time() - st.st_mtime < OLD_IPC_FILE_MIN_AGE_S:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:  # a pid of another pid namespace
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True  # nobody listens
        except OSError:
            return False
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
to_frontend_decoder = msgspec.msgpack.Decoder(ToFrontend)


class RefusalCounter:
    """Calls the public API refused or ended with a status, by status code: counted, and logged at INFO at
    most once a second per code (a burst of refusals must not flood the log)."""

    def __init__(self, model_name: Callable[[], str], log_interval: float = 1.0) -> None:
        self._model_name = model_name
        self._counts: dict[str, int] = {}
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._interval = log_interval
        self.listener: Callable[[str], None] | None = None  # an api server forwards each to the engine core

    def add(self, code: str, message: str) -> None:
        self._counts[code] = self._counts.get(code, 0) + 1
        if self.listener is not None:
            self.listener(code)
        now = time.monotonic()
        if now - self._last_log.get(code, -math.inf) < self._interval:
            self._unlogged[code] = self._unlogged.get(code, 0) + 1
            return
        more = self._unlogged.pop(code, 0)
        self._last_log[code] = now
        log.info("refused a call with %s: %s%s", code, message,
                 f" (and {more} more since the last such line)" if more else "")

    def merge(self, counts: dict[str, int]) -> None:
        """Counts an api server process refused (logged there)."""
        for code, n in counts.items():
            self._counts[code] = self._counts.get(code, 0) + n

    def count(self, code: str) -> int:
        return self._counts.get(code, 0)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("pagedserve:requests_refused", "Generate calls refused or ended with a "
                                     "non-OK status, by gRPC status code", labels=["model_name", "code"])
        for code, n in sorted(self._counts.items()):
            family.add_metric([self._model_name(), code], n)
        yield family
