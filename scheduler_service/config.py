"""Scheduler service configuration: one dataclass, vLLM's flag names."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from protos.wire import DEFAULT_MAX_REQUEST_BYTES
from scheduler_service.core.config import CoreConfig, PreemptionMode, Victim
from scheduler_service.core.policy import Policy
from scheduler_service.membership import parse_target


@dataclass(slots=True)
class SchedulerServiceConfig:
    listen: str = "127.0.0.1:50051"
    http_listen: str | None = None
    executor: list[str] = field(default_factory=lambda: ["127.0.0.1:50061"])
    metrics_port: int | None = 8000
    metrics_host: str = "127.0.0.1"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduler_delay_factor: float = 0.0
    policy: str = "fcfs"
    preemption_mode: str = "auto"
    preemption_victim: str = "latest"
    watermark: float = 0.01
    num_lookahead_slots: int = 0
    num_scheduler_steps: int = 1
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    aging_rate: float = 0.0
    max_waiting_time: float | None = None
    max_queue_len: int = 10000
    max_logprobs: int = 20
    served_model_name: str | None = None
    tokenizer: str | None = None
    shutdown_timeout: float = 30.0
    executor_step_timeout: float = 600.0
    executor_resolve_interval: float = 5.0
    executor_hosts_file: str | None = None
    executor_drain_file: str | None = None
    executor_wait_timeout: float = 30.0
    executor_secret_file: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    api_key: list[str] = field(default_factory=list)
    api_key_file: str | None = None
    api_server_count: int | None = None
    async_scheduling: bool = True
    steps_in_flight: int = 2
    max_stream_buffer: int = 1024

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> SchedulerServiceConfig:
        args = vars(build_parser().parse_args(argv))
        if args["metrics_port"] is not None and args["metrics_port"] < 0:
            args["metrics_port"] = None
        return cls(**args)

    def core(self) -> CoreConfig:
        return CoreConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            policy=Policy(self.policy), preemption_mode=PreemptionMode(self.preemption_mode),
            preemption_victim=Victim(self.preemption_victim), watermark=self.watermark,
            scheduler_delay_factor=self.scheduler_delay_factor, num_lookahead_slots=self.num_lookahead_slots,
            num_scheduler_steps=self.num_scheduler_steps, enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            long_prefill_token_threshold=self.long_prefill_token_threshold, aging_rate=self.aging_rate,
            max_waiting_time=self.max_waiting_time,
            async_scheduling=self.async_scheduling and self.num_scheduler_steps == 1)


def build_parser() -> argparse.ArgumentParser:
    d = SchedulerServiceConfig()
    p = argparse.ArgumentParser(prog="python -m scheduler_service", description="pagedserve scheduler")
    p.add_argument("--listen", default=d.listen, help="HOST:PORT for the public Generation API")
    p.add_argument("--http-listen", default=None,
                   help="HOST:PORT for the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                   "/v1/models, /health); off by default")
    p.add_argument("--executor", action="append", default=None,
                   help="executor HOST:PORT, or dns:///NAME:PORT for every address NAME resolves to "
                   "(repeatable; the pool follows DNS at run time)")
    p.add_argument("--executor-resolve-interval", type=float, default=d.executor_resolve_interval,
                   help="seconds between re-resolutions of dns:/// executors and re-reads of the drain file")
    p.add_argument("--executor-hosts-file", default=None,
                   help="hosts(5)-format file consulted before DNS for dns:/// names, re-read at every resolution")
    p.add_argument("--executor-drain-file", default=None,
                   help="file of executors (HOST:PORT or dns:///NAME:PORT, one a line) to drain: no new work, "
                   "waiting requests move, running ones finish; re-read every interval and on SIGHUP")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus port; -1 disables")
    p.add_argument("--metrics-host", default=d.metrics_host)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--scheduler-delay-factor", type=float, default=d.scheduler_delay_factor)
    p.add_argument("--policy", choices=[x.value for x in Policy], default=d.policy)
    p.add_argument("--preemption-mode", choices=[x.value for x in PreemptionMode], default=d.preemption_mode)
    p.add_argument("--preemption-victim", choices=[x.value for x in Victim], default=d.preemption_victim)
    p.add_argument("--watermark", type=float, default=d.watermark)
    p.add_argument("--num-lookahead-slots", type=int, default=d.num_lookahead_slots)
    p.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="reuse the KV of cached full blocks of a prompt's prefix (on by default)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
    p.add_argument("--aging-rate", type=float, default=d.aging_rate,
                   help="priority units gained per second of waiting (sjf, priority)")
    p.add_argument("--max-waiting-time", type=float, default=None,
                   help="seconds after which a waiting request goes to the head of the queue")
    p.add_argument("--max-queue-len", type=int, default=d.max_queue_len)
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the executor's)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds SIGTERM lets running requests finish before aborting them")
    p.add_argument("--executor-step-timeout", type=float, default=d.executor_step_timeout,
                   help="seconds without an answer to a step before the executor counts as lost")
    p.add_argument("--executor-wait-timeout", type=float, default=d.executor_wait_timeout,
                   help="seconds a call waits for an executor (new calls, and calls in flight when it is lost) "
                   "before it ends with UNAVAILABLE")
    p.add_argument("--executor-secret-file", default=None,
                   help="file holding the shared secret the executor requires (its --executor-secret-file)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest GenerateRequest message accepted on the public port")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: public port over TLS; also the client "
                   "certificate toward the executor when --tls-ca is set")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed the executor's certificate (mTLS)")
    p.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    p.add_argument("--api-key-file", default=None, help="file of accepted API keys, one per line")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="front-end processes serving the public port (SO_REUSEPORT) around one engine core "
                   "process (default: cores / 4, 1 to 8); 0 runs everything in one process (the layout "
                   "before the split)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="schedule step N+1 while the executor runs step N (off with --num-scheduler-steps > 1)")
    p.add_argument("--steps-in-flight", type=int, default=d.steps_in_flight,
                   help="with --async-scheduling: steps written to the executor before the oldest one's result "
                   "is read (2: one running, one queued)")
    p.add_argument("--max-stream-buffer", type=int, default=d.max_stream_buffer,
                   help="responses one stream may have waiting for a slow client before it is aborted")
    return p


def default_api_server_count(cpus: int) -> int:
    """One front-end per 4 cores, 1 to 8: the engine core and the executor's host process need a core
    each, and a front-end streams ~30-80k tokens/s per core (docs/architecture.md)."""
    return max(1, min(8, cpus // 4))


def parse_config(argv: list[str] | None = None) -> SchedulerServiceConfig:
    config = SchedulerServiceConfig.from_args(argv)
    if not config.executor:
        config.executor = ["127.0.0.1:50061"]
    if config.api_server_count is None:
        config.api_server_count = default_api_server_count(len(os.sched_getaffinity(0)))
    if config.api_server_count < 0:
        raise SystemExit("--api-server-count must be >= 0")
    if config.steps_in_flight < 2:
        raise SystemExit("--steps-in-flight must be >= 2 (use --no-async-scheduling for one)")
    if config.max_stream_buffer < 1:
        raise SystemExit("--max-stream-buffer must be >= 1")
    for text in config.executor:
        try:
            parse_target(text)
        except ValueError as e:
            raise SystemExit(f"--executor: {e}") from None
    if config.executor_resolve_interval <= 0:
        raise SystemExit("--executor-resolve-interval must be > 0")
    return config
