"""TLS on the public port, mutual TLS between scheduler and executor, API keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client.lib import PagedServeClient
from tests.support.certs import CertPair, make_ca, make_leaf
from tests.support.procs import Stack, running_stack, start

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPair]:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_cert, ca_key = make_ca(d)
    return {"ca": ca, "server": make_leaf(d, "server", ca_cert, ca_key),
            "executor": make_leaf(d, "executor", ca_cert, ca_key),
            "scheduler": make_leaf(d, "scheduler", ca_cert, ca_key)}


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, CertPair]) -> Iterator[Stack]:
    ex = ["--simulated", "--tls-cert", pki["executor"].cert, "--tls-key", pki["executor"].key,
          "--tls-ca", pki["ca"].cert]
    sc = ["--tls-cert", pki["scheduler"].cert, "--tls-key", pki["scheduler"].key, "--tls-ca", pki["ca"].cert,
          "--api-key", "sekrit"]
    with running_stack(tmp_path_factory.mktemp("tls"), ex, sc, tls_ca=pki["ca"].cert) as s:
        yield s


async def tokens(client: PagedServeClient) -> list[int]:
    return [t async for r in client.generate("hello", max_tokens=4) for t in r.token_ids]


async def test_tls_and_mtls_round_trip_with_api_key(tls_stack: Stack, pki: dict[str, CertPair]) -> None:
    async with PagedServeClient(tls_stack.address, tls_ca=pki["ca"].cert, api_key="sekrit") as client:
        assert len(await tokens(client)) == 4


async def test_wrong_or_missing_api_key_is_unauthenticated(tls_stack: Stack, pki: dict[str, CertPair]) -> None:
    for key in ("wrong", None):
        async with PagedServeClient(tls_stack.address, tls_ca=pki["ca"].cert, api_key=key) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await tokens(client)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await client.health()


def test_binary_metadata_beside_a_valid_key_is_fine(tls_stack: Stack, pki: dict[str, CertPair]) -> None:
    from protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    creds = grpc.ssl_channel_credentials(root_certificates=Path(pki["ca"].cert).read_bytes())
    with grpc.secure_channel(tls_stack.address, creds) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2))
        metadata = [("x-trace-bin", b"\xff\xfe"), ("authorization", "Bearer sekrit")]
        assert sum(len(r.token_ids) for r in stub.Generate(request, metadata=metadata, timeout=30)) == 2


async def test_plaintext_client_cannot_talk_to_tls_port(tls_stack: Stack) -> None:
    async with PagedServeClient(tls_stack.address, api_key="sekrit") as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await tokens(client)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_executor_refuses_a_client_without_certificate(tls_stack: Stack, pki: dict[str, CertPair]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = grpc.ssl_channel_credentials(root_certificates=Path(pki["ca"].cert).read_bytes())
    with grpc.secure_channel(tls_stack.executor_address, creds) as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_api_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nalpha\n\nbeta\n")
    with running_stack(tmp_path, ["--simulated"], ["--api-key-file", str(keys)]) as s:
        import asyncio

        async def check() -> None:
            async with PagedServeClient(s.address, api_key="beta") as client:
                assert len(await tokens(client)) == 4
            async with PagedServeClient(s.address, api_key="gamma") as client:
                with pytest.raises(grpc.aio.AioRpcError):
                    await tokens(client)

        asyncio.run(check())


def test_executor_listens_on_loopback_by_default(tmp_path: Path) -> None:
    from executor_service.config import ExecutorConfig

    assert ExecutorConfig.from_args([]).listen.startswith("127.0.0.1:")
    proc = start("executor_service", ["--simulated", "--listen", "127.0.0.1:0", "--tls-cert", "x.crt"],
                 tmp_path / "bad.log")
    assert proc.wait(timeout=60) != 0
    assert "--tls-cert and --tls-key go together" in (tmp_path / "bad.log").read_text()
