"""Wire settings every side of pagedserve shares: message size limits and TLS credentials."""

from __future__ import annotations

from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
EXECUTOR_SECRET_METADATA_KEY = "x-pagedserve-executor-secret"
# gRPC core keeps calls the application has not picked up yet in a backlog; past its soft limit (1000 by
# default) it cancels a random share of new calls, past the hard limit (3000) all of them, and it cancels
# a call still unpicked after 30 s; the application never sees any of them. Raised, so that a burst
# reaches the service, which then answers each call or refuses it with a status it logs and counts.
MAX_UNACCEPTED_CALLS = 32_768
MAX_UNACCEPTED_SECONDS = 120
# Keepalive pings on the executor link: a peer that stops answering (hung, partitioned) is found within
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS even when no step is in flight.
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.server.max_pending_requests", MAX_UNACCEPTED_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", MAX_UNACCEPTED_CALLS),
                ("grpc.server_max_unrequested_time_in_server", MAX_UNACCEPTED_SECONDS)]
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                     ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.max_pings_without_data", 0),
                     ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
                     ("grpc.http2.max_ping_strikes", 0),
                     ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS)]
# A restarted executor is found within ~2 s, not after gRPC's default back-off of up to 120 s.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2_000)]
EXECUTOR_LINK_OPTIONS = GRPC_OPTIONS + KEEPALIVE_OPTIONS + RECONNECT_OPTIONS


def public_server_options(max_request_bytes: int) -> list[tuple[str, int]]:
    """The public port: requests larger than max_request_bytes are refused by gRPC before they are parsed."""
    return [*(o for o in GRPC_OPTIONS if o[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", max_request_bytes)]


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def read_secret(path: str | None) -> str | None:
    """A shared secret from a file (surrounding whitespace dropped); None without a file."""
    if not path:
        return None
    secret = Path(path).read_text().strip()
    if not secret:
        raise SystemExit(f"secret file {path} is empty")
    return secret


def server_credentials(cert: str, key: str, ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for a listening port; with a CA, clients must present a certificate it signed (mutual TLS)."""
    pair = [(_read(key), _read(cert))]
    return grpc.ssl_server_credentials(pair, root_certificates=_read(ca), require_client_auth=ca is not None)


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None
                        ) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def add_port(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
    if credentials is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, credentials)


def open_channel(address: str, credentials: grpc.ChannelCredentials | None,
                 options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
    options = GRPC_OPTIONS if options is None else options
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)
