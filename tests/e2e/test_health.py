"""Health follows the executor; reflection lists the services; metrics carry vLLM's names."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.e2e.test_production import serving
from tests.support.procs import free_port, loopback, running_stack, start, start_listening, stop, wait_until

DESIGN_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
    "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:cpu_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_success_total{length}", "pagedserve:scheduler_step_seconds_count",
]


def test_health_is_not_serving_until_an_executor_answers(tmp_path: Path) -> None:
    ex_addr = f"127.0.0.1:{free_port()}"  # known before the executor starts: the scheduler dials it first
    scheduler, ports = start_listening("scheduler_service", ["--executor", ex_addr, "--metrics-port", "-1"],
                                       tmp_path / "scheduler.log")
    sc_addr = loopback(ports["listen"])
    try:
        wait_until(lambda: (tmp_path / "scheduler.log").read_text().count("waiting for executor") > 0,
                   what="scheduler listening")
        assert not serving(sc_addr)
        executor = start("executor_service", ["--simulated", "--listen", ex_addr], tmp_path / "executor.log")
        wait_until(lambda: serving(sc_addr), timeout=60, what="SERVING once the executor is up")
        stop(executor, signal.SIGKILL)
        wait_until(lambda: not serving(sc_addr), timeout=30, what="NOT_SERVING once the executor is gone")
        executor = start("executor_service", ["--simulated", "--listen", ex_addr], tmp_path / "executor2.log")
        wait_until(lambda: serving(sc_addr), timeout=60, what="SERVING again after a restart")
        stop(executor)
    finally:
        stop(scheduler)


def test_reflection_lists_the_public_services(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["--simulated"]) as s, grpc.insecure_channel(s.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(iter(stub.ServerReflectionInfo(iter([request]))))
        names = {svc.name for svc in response.list_services_response.service}
        assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_metrics_use_vllm_names(tmp_path: Path) -> None:
    import asyncio

    from client.lib import PagedServeClient

    async def one(address: str) -> None:
        async with PagedServeClient(address) as client:
            async for _ in client.generate("hello", max_tokens=3):
                pass

    with running_stack(tmp_path, ["--simulated"]) as s:
        asyncio.run(one(s.address))
        metrics = s.metrics()
    missing = [name for name in DESIGN_METRICS if name not in metrics]
    assert not missing
    assert metrics["vllm:generation_tokens_total"] == 3
    assert metrics["vllm:prompt_tokens_total"] == 5
