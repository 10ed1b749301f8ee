"""The engine core's front-end socket takes messages from any peer that gets through (on loopback, without
--engine-core-secret-file, any local process): one that is not a front-end's message must be refused alone. It
ended the core's intake task: the core heard no front-end again and dropped them all as silent."""

from __future__ import annotations

from pathlib import Path

import zmq

from client.lib import PagedServeClient
from tests.support.streams import EXECUTOR
from tests.support.tiers import running_tiers


async def test_a_message_that_is_not_a_frontends_leaves_the_core_serving(tmp_path: Path) -> None:
    with running_tiers(tmp_path, EXECUTOR) as tiers:
        ctx = zmq.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.connect(tiers.core_address)
        peer.send(b"\xc1 not msgpack")
        peer.send_multipart([b"two", b"frames"])
        peer.close(linger=2000)  # both sent before the request below
        ctx.term()
        async with PagedServeClient(tiers.public) as client:
            tokens = [t async for r in client.generate("hello", max_tokens=8, ignore_eos=True, timeout=20)
                      for t in r.token_ids]
        assert len(tokens) == 8
        assert "refused a message that is not a front-end's" in (tmp_path / "core-1.log").read_text()
