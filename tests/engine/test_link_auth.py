"""The engine-core link's CURVE security from one shared secret (#28): the right secret gets through, a wrong one
or none does not; an address other hosts can reach needs a secret."""

from __future__ import annotations

import asyncio
import re

import pytest
import zmq
import zmq.asyncio

from scheduler_service.link_auth import check_address, is_local, key_pair, secure_client, secure_server


async def delivered(server_secret: str, client_secret: str | None) -> bool:
    """Whether one message from a client with client_secret reaches a server with server_secret."""
    ctx = zmq.asyncio.Context()
    server = ctx.socket(zmq.ROUTER)
    auth = secure_server(ctx, server, server_secret)
    client = ctx.socket(zmq.DEALER)
    try:
        server.bind("tcp://127.0.0.1:0")
        address = server.getsockopt_string(zmq.LAST_ENDPOINT)
        secure_client(client, client_secret)
        client.connect(address)
        await client.send(b"hello")
        return await server.poll(1500) != 0
    finally:
        client.close(linger=0)
        server.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()


async def test_only_the_shared_secret_gets_through() -> None:
    right, wrong, plain = await asyncio.gather(delivered("s3cret", "s3cret"), delivered("s3cret", "other"),
                                               delivered("s3cret", None))
    assert (right, wrong, plain) == (True, False, False)


def test_keys_are_a_function_of_the_secret_and_role() -> None:
    assert key_pair("a", "core") == key_pair("a", "core")
    assert key_pair("a", "core") != key_pair("b", "core") and key_pair("a", "core") != key_pair("a", "frontend")


def test_an_address_other_hosts_reach_needs_a_secret() -> None:
    assert is_local("ipc:///tmp/x") and is_local("tcp://127.0.0.1:5") and is_local("tcp://[::1]:5")
    assert not is_local("tcp://0.0.0.0:5") and not is_local("tcp://core.internal:5")
    check_address("tcp://0.0.0.0:5", "secret", "--engine-core-listen")
    with pytest.raises(SystemExit, match=re.escape("--engine-core-listen: tcp://0.0.0.0:5 is reachable")):
        check_address("tcp://0.0.0.0:5", None, "--engine-core-listen")
    with pytest.raises(SystemExit, match="neither"):
        check_address("http://x:5", None, "--engine-core")
