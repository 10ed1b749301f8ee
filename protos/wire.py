"""Wire settings every side of pagedserve shares: message size limits and TLS credentials."""

from __future__ import annotations

from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


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


def open_channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=GRPC_OPTIONS)
