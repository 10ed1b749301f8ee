"""The engine-core link's security, shared by both tiers: ZeroMQ CURVE (encryption and authentication) with
both key pairs derived from one shared secret (--engine-core-secret-file), so operators hand out a file, not
keys. The core accepts only the client key derived from the secret (a ZAP handler); a peer without the secret
cannot finish the handshake. Without a secret only loopback and ipc:// addresses are allowed."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
TENANT_KEY_LABEL = b"pagedserve api-key tenant digest key v1"


def key_pair(secret: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys for `role` ("core" or "frontend"), a function of the secret only."""
    private = zmq.utils.z85.encode(hashlib.sha256(f"pagedserve-{role}\0{secret}".encode()).digest())
    return zmq.curve_public(private), private


def tenant_key(secret: str | None) -> bytes | None:
    """The key of the API-key tenant digests (frontend/auth.py TenantScope) that every front-end and api server
    holding the link secret computes alike: HMAC-SHA256 of a label of its own under the secret (a one-way
    derivation, separate from the CURVE keys; the secret itself is never the key). None without a secret."""
    if secret is None:
        return None
    return hmac.new(secret.encode(), TENANT_KEY_LABEL, hashlib.sha256).digest()


def is_local(address: str) -> bool:
    """Whether a ZeroMQ endpoint stays on this host: ipc://, or tcp:// on a loopback address."""
    if address.startswith("ipc://"):
        return True
    host = urlsplit(address).hostname or ""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(address: str, secret: str | None, flag: str) -> None:
    """A clear error for an endpoint ZeroMQ cannot use, or one off this host without a secret."""
    if not address.startswith(("ipc://", "tcp://")):
        raise SystemExit(f"{flag}: {address!r} is neither tcp://HOST:PORT nor ipc://PATH")
    if secret is None and not is_local(address):
        raise SystemExit(f"{flag}: {address} is reachable from other hosts: give --engine-core-secret-file "
                         "(CURVE encryption and authentication), or listen on a loopback or ipc:// address")


class FrontendKey:
    """The ZAP check: only the front-end key derived from the shared secret gets in."""

    def __init__(self, secret: str) -> None:
        self.allowed = key_pair(secret, "frontend")[0]

    def callback(self, domain: str, key: bytes | str) -> bool:
        return (key.encode() if isinstance(key, str) else key) == self.allowed


def secure_server(ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket, secret: str | None
                  ) -> AsyncioAuthenticator | None:
    """Make `sock` a CURVE server for the secret (before bind); the authenticator to stop at close."""
    if secret is None:
        return None
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", FrontendKey(secret))
    public, private = key_pair(secret, "core")
    sock.curve_secretkey = private
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.asyncio.Socket, secret: str | None) -> None:
    """Make `sock` a CURVE client of the core for the secret (before connect)."""
    if secret is None:
        return
    public, private = key_pair(secret, "frontend")
    sock.curve_secretkey = private
    sock.curve_publickey = public
    sock.curve_serverkey = key_pair(secret, "core")[0]
