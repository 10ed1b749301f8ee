"""Scheduler service configuration: one dataclass, vLLM's flag names; the flags are derived from it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from client.cpu_cores import parse_cores
from client.flags import add_flags, config_from, flag
from client.port_file import check_port_file
from protos.wire import DEFAULT_MAX_REQUEST_BYTES
from scheduler_service.core.config import CoreConfig
from scheduler_service.frontend.openai.tools import ToolCallParser

DNS_SCHEME = "dns:///"


@dataclass(frozen=True, slots=True)
class ExecutorTarget:
    host: str
    port: int
    dns: bool = False

    def __str__(self) -> str:
        return f"{DNS_SCHEME if self.dns else ''}{self.address}"

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_target(text: str) -> ExecutorTarget:
    """`HOST:PORT` (one executor) or `dns:///NAME:PORT` (every address NAME resolves to); ValueError if neither."""
    dns = text.startswith(DNS_SCHEME)
    rest = text[len(DNS_SCHEME):] if dns else text
    host, sep, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"executor address {text!r} is neither HOST:PORT nor {DNS_SCHEME}NAME:PORT")
    return ExecutorTarget(host, int(port), dns)


@dataclass(slots=True)
class SchedulerServiceConfig(CoreConfig):
    """The scheduler service's settings: the core's knobs (CoreConfig) and the service's own."""

    listen: str = field(default="127.0.0.1:50051", metadata=flag("HOST:PORT for the public Generation API"))
    http_listen: str | None = field(default=None, metadata=flag(
        "HOST:PORT for the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health); off by default"))
    http_header_timeout: float = field(default=10.0, metadata=flag(
        "seconds an HTTP request's line and headers may take from their first byte; then its connection is closed"))
    http_body_timeout: float = field(default=60.0, metadata=flag(
        "seconds an HTTP request's body may take after its headers; then 408 and its connection is closed"))
    http_timeout_keep_alive: float = field(default=5.0, metadata=flag(
        "seconds an HTTP connection may wait for its next request, or its first, before it is closed (vLLM's "
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE)"))
    http_max_connections: int = field(default=4096, metadata=flag(
        "most open HTTP connections per api server, at most half its open-file limit: past it the one waiting "
        "longest for a request is closed, or, when all are serving requests, the new one gets 503"))
    http_write_timeout: float = field(default=30.0, metadata=flag(
        "seconds an HTTP response's writes may wait for its client to read (its send buffer full) before the "
        "connection is dropped and its requests aborted, their KV blocks freed"))
    grpc_write_timeout: float = field(default=30.0, metadata=flag(
        "seconds a Generate response may wait for its gRPC client to read (flow control holding the write) before "
        "the call's handler is cancelled and its request aborted, its KV blocks freed"))
    http_send_buffer: int = field(default=256 * 1024, metadata=flag(
        "bytes of an HTTP response the kernel holds unread per connection (SO_SNDBUF; as many again in the server) "
        "before writes wait; 0 leaves the kernel's autotuned size (up to ~4 MB)"))
    executor: list[str] = field(default_factory=lambda: ["127.0.0.1:50061"], metadata=flag(
        "executor HOST:PORT, or dns:///NAME:PORT for every address NAME resolves to (repeatable; the pool "
        "follows DNS at run time)"))
    executor_resolve_interval: float = field(default=5.0, metadata=flag(
        "seconds between re-resolutions of dns:/// executors (a front-end: dns:/// engine cores) and re-reads of "
        "the drain file"))
    executor_hosts_file: str | None = field(default=None, metadata=flag(
        "hosts(5)-format file consulted before DNS for dns:/// names, re-read at every resolution"))
    executor_drain_file: str | None = field(default=None, metadata=flag(
        "file of executors (HOST:PORT or dns:///NAME:PORT, one a line) to drain: no new work, waiting requests "
        "move, running ones finish; re-read every interval and on SIGHUP"))
    metrics_port: int | None = field(default=8000, metadata=flag("Prometheus port; -1 disables, 0 picks a free one"))
    port_file: str | None = field(default=None, metadata=flag(
        "file the service writes the ports it bound into, as JSON keyed by flag name ({\"listen\": N, "
        "\"http_listen\": N, \"metrics_port\": N, \"engine_core_listen\": N}): with port 0 in those flags, the "
        "kernel picks free ports and this says which"))
    metrics_host: str = "127.0.0.1"
    max_queue_len: int = 10000
    max_logprobs: int = 20
    served_model_name: str | None = None
    tokenizer: str | None = field(default=None, metadata=flag(
        "directory with tokenizer.json (default: the executor's)"))
    shutdown_timeout: float = field(default=30.0, metadata=flag(
        "seconds SIGTERM lets running requests finish before aborting them"))
    executor_step_timeout: float = field(default=600.0, metadata=flag(
        "seconds without an answer to a step before the executor counts as lost"))
    executor_wait_timeout: float = field(default=30.0, metadata=flag(
        "seconds a call waits for an executor (new calls, and calls in flight when it is lost) before it ends "
        "with UNAVAILABLE"))
    structured_outputs_compile_timeout: float = field(default=10.0, metadata=flag(
        "seconds a structured-output constraint may take to compile (in the engine core's compile process) before "
        "the process is killed and the request refused: 400 / INVALID_ARGUMENT, grammar too complex"))
    executor_secret_file: str | None = field(default=None, metadata=flag(
        "file holding the shared secret the executor requires (its --executor-secret-file)"))
    max_request_bytes: int = field(default=DEFAULT_MAX_REQUEST_BYTES, metadata=flag(
        "largest GenerateRequest message accepted on the public port"))
    tls_cert: str | None = field(default=None, metadata=flag(
        "PEM certificate: public port over TLS; also the client certificate toward the executor when --tls-ca "
        "is set"))
    tls_key: str | None = field(default=None, metadata=flag("PEM private key for --tls-cert"))
    tls_ca: str | None = field(default=None, metadata=flag("PEM CA that signed the executor's certificate (mTLS)"))
    api_key: list[str] = field(default_factory=list, metadata=flag("accepted API key (repeatable)"))
    api_key_file: str | None = field(default=None, metadata=flag("file of accepted API keys, one per line"))
    enable_cross_tenant_prefix_caching: bool = field(default=False, metadata=flag(
        "with API keys, let every key's requests share one prefix cache (off: each key's requests hit only "
        "blocks its own requests computed, so no tenant can time another's prompts)"))
    tool_call_parser: ToolCallParser = field(default=ToolCallParser.NONE, metadata=flag(
        "how tool_choice auto reads tool calls from the model's text (hermes: <tool_call>{...}</tool_call>, "
        "llama3_json: {\"name\": ..., \"parameters\": ...}); none refuses auto (required and named work always)"))
    api_server_count: int | None = field(default=None, metadata=flag(
        "front-end processes serving the public port (SO_REUSEPORT) around one engine core process (default: "
        "cores / 4, 1 to 8); 0 runs everything in one process (the layout before the split)"))
    async_scheduling: bool = field(default=True, metadata=flag(
        "schedule step N+1 while the executor runs step N (off with --num-scheduler-steps > 1)"))
    steps_in_flight: int = field(default=2, metadata=flag(
        "with --async-scheduling: steps written to the executor before the oldest one's result is read (2: one "
        "running, one queued)"))
    engine_core_listen: str | None = field(default=None, metadata=flag(
        "engine core: tcp://HOST:PORT or ipc://PATH on which front-ends (its own api servers and any started with "
        "`python -m scheduler_service.frontend`) connect (default: a fresh ipc:// path for its own api servers)"))
    engine_core: list[str] = field(default_factory=list, metadata=flag(
        "front-end (`python -m scheduler_service.frontend`): an engine core's tcp://HOST:PORT or ipc://PATH, or "
        "dns:///NAME:PORT for a core at every address NAME resolves to, re-resolved every "
        "--executor-resolve-interval seconds (repeatable: new requests go to the least loaded ready core; a lost "
        "core's requests move to the others)"))
    engine_core_secret_file: str | None = field(default=None, metadata=flag(
        "file holding the shared secret of the engine-core link (CURVE encryption and authentication); needed "
        "for an address other hosts can reach"))
    engine_core_timeout: float = field(default=5.0, metadata=flag(
        "seconds of silence after which a front-end counts its engine core lost (and re-submits its requests) and "
        "the core drops a front-end (aborting its requests); each side sends a heartbeat every quarter of it"))
    engine_core_wait_timeout: float = field(default=60.0, metadata=flag(
        "seconds a front-end keeps the open requests of a lost engine core waiting for it to come back before "
        "they end with UNAVAILABLE"))
    cpu_nice: int = field(default=0, metadata=flag(
        "raise the scheduler side's nice value by this much (0 - 19; its api servers inherit it): on cores shared "
        "with a CPU executor it then runs in the executor's idle moments instead of preempting its OpenMP team "
        "(docs/operations.md, CPU placement)"))
    cpu_cores: str = field(default="", metadata=flag(
        "bind the scheduler side (engine core and its api servers) to these cores, e.g. '14,15' or '1': the cores "
        "the executor's --cpu-cores leaves, as `taskset -c` would ('': wherever the OS puts it)"))
    max_stream_buffer: int = field(default=1024, metadata=flag(
        "responses one stream may have waiting for a slow client before it is aborted"))

    @classmethod
    def from_args(cls, argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
                  ) -> SchedulerServiceConfig:
        config = config_from(cls, (parser or build_parser()).parse_args(argv))
        if config.metrics_port is not None and config.metrics_port < 0:
            config.metrics_port = None
        return config

    def core(self) -> CoreConfig:
        core = CoreConfig(**{f.name: getattr(self, f.name) for f in fields(CoreConfig)})
        core.async_scheduling = self.async_scheduling and self.num_scheduler_steps == 1
        return core


def build_parser(prog: str = "python -m scheduler_service", description: str = "pagedserve scheduler"
                 ) -> argparse.ArgumentParser:
    """The scheduler's flags under `prog` (a front-end of its own shares them: `python -m
    scheduler_service.frontend`, `pagedserve frontend`)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(p, SchedulerServiceConfig)
    return p


def default_api_server_count(cpus: int) -> int:
    """One front-end per 4 cores, 1 to 8: the engine core and the executor's host process need a core
    each, and a front-end streams ~30-80k tokens/s per core (docs/architecture.md)."""
    return max(1, min(8, cpus // 4))


def parse_config(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
                 ) -> SchedulerServiceConfig:
    config = SchedulerServiceConfig.from_args(argv, parser)
    check_port_file(config.port_file)
    if not config.executor:
        config.executor = ["127.0.0.1:50061"]
    if config.api_server_count is None:
        config.api_server_count = default_api_server_count(len(os.sched_getaffinity(0)))
    if config.api_server_count < 0:
        raise SystemExit("--api-server-count must be >= 0")
    if config.steps_in_flight < 2:
        raise SystemExit("--steps-in-flight must be >= 2 (use --no-async-scheduling for one)")
    if not 0 <= config.cpu_nice <= 19:
        raise SystemExit(f"--cpu-nice must be 0 - 19, got {config.cpu_nice}")
    try:
        parse_cores(config.cpu_cores)
    except ValueError as e:
        raise SystemExit(f"--cpu-cores: {e}") from None
    if config.max_stream_buffer < 1:
        raise SystemExit("--max-stream-buffer must be >= 1")
    for text in config.executor:
        try:
            parse_target(text)
        except ValueError as e:
            raise SystemExit(f"--executor: {e}") from None
    for name in ("engine_core_timeout", "engine_core_wait_timeout", "structured_outputs_compile_timeout"):
        if getattr(config, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if config.executor_resolve_interval <= 0:
        raise SystemExit("--executor-resolve-interval must be > 0")
    for name in ("http_header_timeout", "http_body_timeout", "http_timeout_keep_alive", "http_max_connections",
                 "http_write_timeout", "grpc_write_timeout"):
        if getattr(config, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if config.http_send_buffer < 0:
        raise SystemExit("--http-send-buffer must be >= 0 (0: the kernel's own size)")
    return config
