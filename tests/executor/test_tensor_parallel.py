"""Tensor parallelism on the CPU with gloo: the shard layout and loader, the step channel's packing, the
launch flags, greedy equality of --tensor-parallel-size 2 with size 1 and with transformers through the
whole gRPC stack (also under swap and recompute), and fail-stop when a rank dies.

Kept small (two ranks, few short requests): the test machine has two shared cores.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from client.lib import PagedServeClient
from client.port_file import wait_ports
from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import TOKENIZER_VOCAB_SIZE, ensure_default_model, make_model
from executor_service.model import ModelConfig, ModelLoadError, ModelOps, ParallelContext, ShardLayout, load_model
from executor_service.parallel.channel import TensorSpec, collect_specs, fill_tensors, pack, strip_tensors, unpack
from executor_service.parallel.topology import LaunchError, resolve_topology
from executor_service.runner.torch_backend import TorchBackend, build_batch
from protos.pagedserve.v1 import generation_pb2
from scheduler_service.core.config import CoreConfig, PreemptionMode
from scripts.arrival_spread import Batch, make_prompts, sweep
from tests.support import tp_peer
from tests.support.procs import (
    ROOT,
    Stack,
    free_port,
    loopback,
    port_file_of,
    process_gone,
    running_stack,
    start,
    start_listening,
    stop,
    wait_healthy,
    wait_until,
)

transformers = pytest.importorskip("transformers")

TP2 = ["--tensor-parallel-size", "2"]
DEVICE = os.environ.get("PAGEDSERVE_TP_DEVICE", "cpu")  # cuda needs two GPUs (benchmarks/gpu_check.sh)
BLOCK_SIZE = 16
PROMPT_LENGTHS = (100, 60, 33, 17, 7, 1)
MAX_TOKENS = 48
PLENTY = ["--num-gpu-blocks", "256", "--num-cpu-blocks", "32"]
# The 6 prompts need 18 blocks, 33 by their last token (10 + 7 + 5 + 4 + 4 + 3): 24 admit them all at once, and
# they outgrow the pool by 9 blocks. They need not arrive together: arriving at random steps up to 32 apart (two
# thirds of a request's life) they preempted in each of 200 orders (scripts/arrival_spread.py --prompts
# 100,60,33,17,7,1 --max-tokens 48 --blocks 24); with the 16 tokens and 20 blocks this had, in none of 31 orders of
# 100 only 4 steps apart (a waiting head keeps the pool from filling; 16-step requests end before late ones grow).
TIGHT = ["--num-gpu-blocks", "24", "--num-cpu-blocks", "64"]
MAX_ROUNDS = 3
KILL_RUN_TOKENS = 40
LENGTH = generation_pb2.FINISH_REASON_LENGTH
SWAP = "pagedserve:num_preemptions_by_mode_total{swap}"
RECOMPUTE = "pagedserve:num_preemptions_by_mode_total{recompute}"
STARTED = re.compile(r"tensor-parallel rank 1 started as pid (\d+)")
NO_OPS = ModelOps(lambda *a: None, lambda *a: torch.empty(0))


def make_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + length)
    return torch.randint(3, TOKENIZER_VOCAB_SIZE - 1, (length,), generator=g).tolist()  # fits the odd vocab too


PROMPTS = [make_prompt(n, 7) for n in PROMPT_LENGTHS]


def model_config(**overrides: Any) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    return ModelConfig.from_dict({**raw, **overrides})


# ---- shard layout, loader, channel packing, flags (no processes) ------------------------------------


def test_layout_splits_query_and_kv_heads_and_pads_the_vocabulary() -> None:
    cfg = model_config()
    ranks = [ShardLayout.of(cfg, r, 2) for r in range(2)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in ranks] == [(2, 1, 0), (2, 1, 1)]
    assert [s.intermediate_size for s in ranks] == [24, 24]
    assert [(s.vocab_start, s.vocab_rows, s.vocab_per_rank) for s in ranks] == [(0, 51, 51), (51, 50, 51)]


def test_layout_replicates_kv_heads_when_fewer_than_ranks() -> None:
    cfg = model_config(num_key_value_heads=2)
    ranks = [ShardLayout.of(cfg, r, 4) for r in range(4)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in ranks] == [(1, 1, 0), (1, 1, 0), (1, 1, 1),
                                                                                (1, 1, 1)]


@pytest.mark.parametrize("overrides,size,named", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "num_attention_heads (6)"),
    ({"intermediate_size": 50}, 4, "intermediate_size (50)"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4, "num_key_value_heads (3"),
])
def test_layout_refuses_a_size_that_does_not_divide_the_model(overrides: dict[str, int], size: int,
                                                                named: str) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        ShardLayout.of(model_config(**overrides), 0, size)


@pytest.mark.parametrize("kv_heads,tied", [(2, True), (1, False)])
def test_shards_reassemble_into_the_whole_model(tmp_path: Path, kv_heads: int, tied: bool) -> None:
    """Loading rank 0 and rank 1 of 2 (no process group needed to load) gives exactly the slices of the
    single-rank weights: heads of q/k/v (the one KV head replicated), columns of o_proj/down_proj,
    intermediate rows of gate/up, vocabulary rows of the embedding/LM head with zero padding (odd vocab)."""
    path = make_model(tmp_path / "m", arch="qwen2", hidden_size=32, num_heads=4, num_kv_heads=kv_heads,
                      vocab_size=101, tie_word_embeddings=tied, seed=5)
    cpu = torch.device("cpu")
    whole = load_model(path, device=cpu, dtype=torch.float32, ops=NO_OPS).state_dict()
    shards = [load_model(path, device=cpu, dtype=torch.float32, ops=NO_OPS,
                         parallel=ParallelContext(rank, 2)).state_dict() for rank in range(2)]
    d, q, kv = 8, 32, kv_heads * 8

    def sections(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(t.split(sizes))

    for suffix in ("weight", "bias"):
        full_q, full_k, full_v = sections(whole[f"model.layers.0.self_attn.qkv_proj.{suffix}"], [q, kv, kv])
        per_rank = [sections(s[f"model.layers.0.self_attn.qkv_proj.{suffix}"], [q // 2, d, d]) for s in shards]
        assert torch.equal(torch.cat([p[0] for p in per_rank]), full_q)
        for i, full in ((1, full_k), (2, full_v)):
            expected = full if kv_heads == 2 else torch.cat([full, full])
            assert torch.equal(torch.cat([p[i] for p in per_rank]), expected)
    o = whole["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(torch.cat([s["model.layers.0.self_attn.o_proj.weight"] for s in shards], dim=1), o)
    down = whole["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(torch.cat([s["model.layers.0.mlp.down_proj.weight"] for s in shards], dim=1), down)
    gate, up = whole["model.layers.0.mlp.gate_up_proj.weight"].chunk(2)
    halves = [s["model.layers.0.mlp.gate_up_proj.weight"].chunk(2) for s in shards]
    assert torch.equal(torch.cat([h[0] for h in halves]), gate) and torch.equal(torch.cat([h[1] for h in halves]), up)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = torch.cat([s[name] for s in shards])
        assert rows.shape[0] == 102 and torch.equal(rows[:101], whole[name]) and not rows[101:].any()


def test_a_batch_crosses_the_channel_as_specs_and_one_buffer(tmp_path: Path) -> None:
    config = ExecutorConfig(model=str(make_model(tmp_path / "m", seed=3)), device="cpu", num_gpu_blocks=8,
                            num_cpu_blocks=0, block_size=4)
    info = TorchBackend.create(config).info
    items = [BatchItem("a", list(range(3, 12)), 9, 0, 9, [0, 1, 2], True, SamplingConfig()),
             BatchItem("b", [5, 6, 7], 2, 2, 1, [3], True, SamplingConfig(temperature=0.0))]
    batch = build_batch(items, info, torch.device("cpu"))
    tensors: list[torch.Tensor] = []
    skeleton = strip_tensors(batch, tensors)
    specs: list[Any] = []
    collect_specs(skeleton, specs)
    assert [(s.dtype, s.shape) for s in specs] == [(t.dtype, tuple(t.shape)) for t in tensors]
    assert skeleton.sample_items == [0, 1]
    rebuilt = fill_tensors(skeleton, iter(unpack(pack(tensors, torch.device("cpu")), specs)))
    again: list[torch.Tensor] = []
    strip_tensors(rebuilt, again)
    assert len(again) == len(tensors) >= 7
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(again, tensors, strict=True))
    nested = {"pair": (torch.ones(2), [torch.zeros(1, dtype=torch.bool)]), "n": 3}
    found: list[torch.Tensor] = []
    assert strip_tensors(nested, found) == {"pair": (TensorSpec(torch.float32, (2,)), [TensorSpec(torch.bool, (1,))]),
                                            "n": 3}
    assert [t.dtype for t in found] == [torch.float32, torch.bool]


def test_the_step_channel_delivers_every_call_in_order_across_two_processes() -> None:
    """Block pairs, a small batch (one frame) and a batch over the frame size (two broadcasts), a heartbeat
    and a stop arrive at rank 1 exactly as rank 0 sent them, over a real gloo group."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=tp_peer.channel_peer, args=(rank, port, out)) for rank in range(2)]
    for p in ranks:
        p.start()
    try:
        received = [out.get(timeout=120) for _ in tp_peer.channel_messages()]
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    expected = [(op, mapping, tp_peer.flatten(batch)) for op, mapping, batch in tp_peer.channel_messages()]
    assert received == expected
    assert [p.exitcode for p in ranks] == [0, 0]


def test_topology_from_flags_and_from_torchrun() -> None:
    flags = ExecutorConfig(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    topo = resolve_topology(flags, {})
    assert (topo.nproc_per_node, topo.rank_of(0), topo.rank_of(1), topo.master_port) == (2, 2, 3, 29500)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    topo = resolve_topology(ExecutorConfig(tensor_parallel_size=4), env)
    assert (topo.rank_of(0), topo.torchrun_local_rank, topo.nnodes, topo.master_port) == (3, 1, 2, 1234)
    with pytest.raises(LaunchError, match="WORLD_SIZE=4"):
        resolve_topology(ExecutorConfig(tensor_parallel_size=2), env)
    with pytest.raises(LaunchError, match="multiple of --nnodes"):
        resolve_topology(ExecutorConfig(tensor_parallel_size=3, nnodes=2), {})
    with pytest.raises(LaunchError, match="--node-rank"):
        resolve_topology(ExecutorConfig(tensor_parallel_size=2, nnodes=2, node_rank=2), {})
    with pytest.raises(LaunchError, match="simulated"):
        resolve_topology(ExecutorConfig(tensor_parallel_size=2, simulated=True), {})
    with pytest.raises(LaunchError, match="--distributed-timeout"):
        resolve_topology(ExecutorConfig(tensor_parallel_size=2, distributed_timeout=0), {})


def test_a_size_the_model_cannot_take_fails_at_start_with_one_line(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", num_heads=4, num_kv_heads=2, seed=1)
    proc = subprocess.run([sys.executable, "-m", "executor_service", "--listen", "127.0.0.1:0", "--model", str(path),
                           "--tensor-parallel-size", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "tensor_parallel_size 3 must divide num_attention_heads (4)" in proc.stderr
    assert "Traceback" not in proc.stderr
    spawned = [int(pid) for pid in re.findall(r"tensor-parallel rank \d+ started as pid (\d+)", proc.stderr)]
    assert len(spawned) == 2, "the ranks start before rank 0 imports torch and checks the split"
    assert all(process_gone(pid) for pid in spawned), "rank 0 exited leaving spawned ranks behind"


def test_the_launch_imports_no_torch_before_it_spawns_the_ranks() -> None:
    """The follower ranks import torch while rank 0 does: nothing rank 0 imports before spawning them (the
    entry point, the launch and its spawn target) may import torch, nor may what a child unpickles."""
    probe = ("import sys, executor_service.__main__, executor_service.parallel.launch; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- greedy equality through the whole gRPC stack ------------------------------------------------------


@dataclass
class Run:
    outputs: list[list[int]] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    rounds: int = 0


@dataclass
class Case:
    reference: list[list[int]]
    runs: dict[str, Run]


async def generate_all(address: str, max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], int]]:
    async def one(client: PagedServeClient, prompt: list[int]) -> tuple[list[int], int]:
        ids: list[int] = []
        reason = 0
        async for r in client.generate(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True, timeout=120):
            ids += r.token_ids
            reason = r.finish_reason or reason
        return ids, reason

    async with PagedServeClient(address) as client:
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))


@functools.cache
def hf_greedy(path: Path) -> list[list[int]]:
    """transformers' greedy outputs for PROMPTS, computed once per model (the embedded model's serves the
    fixture's case and the two-node test)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


@contextmanager
def loading(args: list[str], log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An executor started, its port bound, maybe still loading its model: its address and process; it must stop
    cleanly."""
    proc, ports = start_listening("executor_service", args, log)
    try:
        yield loopback(ports["listen"]), proc
    finally:
        assert stop(proc) == 0, f"executor did not stop cleanly; see {log}"


def wait_loaded(address: str, proc: subprocess.Popen[bytes]) -> str:
    wait_healthy(address, proc)
    return address


def serve(address: str, scheduler_args: list[str], log_dir: Path, must_see: str | None = None) -> Run:
    """A scheduler on `address`; the prompts run (up to MAX_ROUNDS times) until must_see is counted."""
    run = Run()
    proc, ports = start_listening("scheduler_service", ["--executor", address, "--metrics-port", "0",
                                                        *scheduler_args], log_dir / "scheduler.log")
    sched_address = loopback(ports["listen"])
    stack = Stack(sched_address, address, proc, proc, [], log_dir, ports)
    try:
        wait_healthy(sched_address, proc)
        stack.ports = wait_ports(port_file_of(log_dir / "scheduler.log"), ("listen", "metrics_port"), proc)
        while run.rounds < MAX_ROUNDS:
            results = asyncio.run(generate_all(sched_address))
            run.outputs += [ids for ids, _ in results]
            run.reasons += [reason for _, reason in results]
            run.rounds += 1
            wait_until(stack.idle, what="the scheduler to go idle")
            run.metrics = stack.metrics()
            if must_see is None or run.metrics.get(must_see, 0) > 0:
                break
    finally:
        stop(proc)
    return run


@pytest.fixture(scope="module", params=["embedded", "qwen2"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    if request.param == "embedded":
        path = ensure_default_model()
    else:  # qkv bias, tied embeddings, 4 query heads over 2 KV heads
        path = make_model(root / "qwen2", arch="qwen2", tie_word_embeddings=True, hidden_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, vocab_size=TOKENIZER_VOCAB_SIZE, init_std=0.2, seed=2)
    model = ["--model", str(path), "--device", DEVICE, "--dtype", "float32", "--block-size", str(BLOCK_SIZE)]
    runs: dict[str, Run] = {}
    (root / "tp1").mkdir()
    with loading([*model, *PLENTY], root / "tp1" / "executor.log") as tp1, \
            loading([*model, *TIGHT, *TP2], root / "executor-tight.log") as tp2:
        reference = hf_greedy(path)  # while both executors load
        # size 1's run goes on a thread alongside size 2's (each executor has its own schedulers, one at a time)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp1") as pool:
            tp1_run = pool.submit(serve, wait_loaded(*tp1), [], root / "tp1")
            address = wait_loaded(*tp2)
            for mode, key in (("swap", SWAP), ("recompute", RECOMPUTE)):
                log_dir = root / mode
                log_dir.mkdir()
                runs[mode] = serve(address, ["--preemption-mode", mode], log_dir, key)
            runs["tp1"] = tp1_run.result()
    return Case(reference, runs)


def test_the_tight_batch_preempts_however_it_arrives() -> None:
    """TIGHT's block arithmetic in the scheduler core (steps, no timing): the batch preempts in each of 20 random
    orders of arrival steps up to two thirds of a request's life apart (16 tokens on 20 blocks: 12 of the 20)."""
    blocks = int(TIGHT[TIGHT.index("--num-gpu-blocks") + 1])
    batch = Batch(make_prompts(list(PROMPT_LENGTHS)), MAX_TOKENS, [1] * len(PROMPT_LENGTHS), blocks, 64, BLOCK_SIZE,
                  CoreConfig(preemption_mode=PreemptionMode.RECOMPUTE))
    missed = [i for i, (swap, recompute) in enumerate(sweep(batch, MAX_TOKENS * 2 // 3, 20)) if swap + recompute == 0]
    assert not missed, f"no preemption in orders {missed}"


@pytest.mark.slow
def test_size_2_equals_size_1_and_transformers(case: Case) -> None:
    """Size 1 with plenty of blocks against size 2 with few (its first round: every request, the
    preempted and the never preempted ones)."""
    assert case.runs["tp1"].outputs == case.reference
    assert case.runs["tp1"].reasons == [LENGTH] * len(PROMPTS)
    assert case.runs["tp1"].metrics["vllm:num_preemptions_total"] == 0
    for mode in ("swap", "recompute"):
        assert case.runs[mode].outputs[: len(PROMPTS)] == case.runs["tp1"].outputs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_size_2_equals_transformers_under_preemption(case: Case, mode: str) -> None:
    run = case.runs[mode]
    assert run.outputs == case.reference * run.rounds
    assert run.reasons == [LENGTH] * len(run.reasons)
    m = run.metrics
    if mode == "swap":
        assert m[SWAP] > 0, f"no swap preemption in {run.rounds} rounds"
        assert m["pagedserve:swap_out_blocks_total"] > 0 and m["pagedserve:swap_in_blocks_total"] > 0
    else:
        assert m[RECOMPUTE] > 0 and m[SWAP] == 0, f"no recompute-only preemption in {run.rounds} rounds"


@pytest.mark.slow
def test_torchrun_starts_the_same_executor(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m executor_service -tp 2`: each process is one rank (RANK, WORLD_SIZE,
    LOCAL_RANK from torchrun); greedy outputs through a scheduler equal transformers'. The model has one KV
    head for the two ranks (replicated on both) and a vocabulary of 2047 (rank 1's shard of the embedding
    and LM head padded by a zero row)."""
    path = make_model(tmp_path / "mistral", arch="mistral", hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=1, vocab_size=TOKENIZER_VOCAB_SIZE - 1, init_std=0.2, seed=4)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "executor_service", *TP2, "--listen", "127.0.0.1:0",
           "--port-file", str(tmp_path / "executor.ports"), "--model", str(path), "--device", DEVICE, "--dtype",
           "float32", *PLENTY]
    with open(tmp_path / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        address = loopback(wait_ports(tmp_path / "executor.ports", ("listen",), proc, timeout=300)["listen"])
        wait_healthy(address, proc)
        run = serve(address, [], tmp_path)
    finally:
        stop(proc)  # torchrun ends its workers with SIGTERM: its own exit status is not ours to check
    assert run.outputs == hf_greedy(path)


@pytest.mark.slow
def test_two_nodes_on_one_machine_serve_like_one(tmp_path: Path) -> None:
    """--nnodes 2 with one rank per node, both nodes on this machine (gloo kept on the loopback): node 0
    serves, node 1 only follows; greedy outputs equal transformers'."""
    port, port_file = free_port(), tmp_path / "executor.ports"  # the rendezvous port: both nodes dial it first
    common = [*TP2, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--device", DEVICE,
              "--dtype", "float32", *PLENTY]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    procs = []
    for node in (1, 0):
        args = [*common, "--node-rank", str(node),
                *(["--listen", "127.0.0.1:0", "--port-file", str(port_file)] if node == 0 else [])]
        with open(tmp_path / f"node{node}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "executor_service", *args], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    node1, node0 = procs
    try:
        address = loopback(wait_ports(port_file, ("listen",), node0, timeout=300)["listen"])
        wait_healthy(address, node0)
        run = serve(address, [], tmp_path)
        assert stop(node0) == 0
        assert node1.wait(timeout=30) == 0, "node 1 should exit when node 0 tells it to stop"
    finally:
        for proc in procs:
            stop(proc)
    assert run.outputs == hf_greedy(ensure_default_model())


# ---- a rank that dies ends the executor --------------------------------------------------------------------


def worker_pid(log: Path, proc: subprocess.Popen[bytes]) -> int:
    wait_until(lambda: STARTED.search(log.read_text(errors="replace")) is not None or proc.poll() is not None,
               what="rank 1 to start")
    match = STARTED.search(log.read_text(errors="replace"))
    assert match, f"rank 1 never started; see {log}"
    return int(match.group(1))


def test_killed_worker_rank_ends_the_executor_and_the_scheduler_recomputes(tmp_path: Path) -> None:
    args = ["--device", DEVICE, "--num-gpu-blocks", "128", "--num-cpu-blocks", "16", *TP2]
    # requests wait for the restarted executor (two ranks starting on a loaded machine) instead of failing
    with running_stack(tmp_path, args, ["--executor-wait-timeout", "600"]) as stack:
        reference = asyncio.run(generate_all(stack.address, KILL_RUN_TOKENS))
        assert all(len(ids) == KILL_RUN_TOKENS for ids, _ in reference)
        pid = worker_pid(tmp_path / "executor.log", stack.executor)

        async def killed_midway() -> list[tuple[list[int], int]]:
            task = asyncio.create_task(generate_all(stack.address, KILL_RUN_TOKENS))
            await asyncio.to_thread(wait_until, lambda: stack.metrics()["vllm:generation_tokens_total"]
                                    >= len(PROMPTS) * (KILL_RUN_TOKENS + 4), 60.0, "the second run to start")
            os.kill(pid, signal.SIGKILL)
            code = await asyncio.to_thread(stack.executor.wait, 30)
            assert code != 0, "rank 0 should exit with an error when rank 1 dies"
            stack.executor = start("executor_service", ["--listen", stack.executor_address, *stack.executor_args],
                                   tmp_path / "executor-2.log")
            return await task

        disturbed = asyncio.run(killed_midway())
        assert process_gone(pid)
        assert disturbed == reference
        assert stack.scheduler.poll() is None


GUARD_RACE = """
import logging, multiprocessing, signal, threading
from executor_service.parallel.supervision import Guard

def stubborn(ready):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # holds the first failure in stop_children (join, then kill)
    ready.set()
    signal.pause()

class Seen(logging.Handler):
    def __init__(self, event):
        super().__init__()
        self.event = event
    def emit(self, record):
        self.event.set()

ctx = multiprocessing.get_context("fork")
ready, first_down = ctx.Event(), threading.Event()
logging.getLogger("pagedserve.executor").addHandler(Seen(first_down))
guard = Guard()
guard.children = [ctx.Process(target=stubborn, args=(ready,), daemon=True)]
guard.children[0].start()
ready.wait()
threading.Thread(target=guard.fail, args=("rank 1 exited",), daemon=True).start()
first_down.wait()
guard.fail("forward pass: connection closed by peer")
print("the second failure returned", flush=True)
"""


def test_a_failure_while_another_ends_the_process_never_returns(tmp_path: Path) -> None:
    """The race behind a killed rank: the child watcher starts ending the process, then the collective in
    flight fails too. The second failure must wait for the exit (its step stays unanswered), not return
    and let the server answer the step as failed."""
    script = tmp_path / "guard_race.py"
    script.write_text(GUARD_RACE)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "the second failure returned" not in done.stdout
    assert done.returncode == 1, done.stderr


def test_killed_rank_0_ends_the_other_ranks(tmp_path: Path) -> None:
    log = tmp_path / "executor.log"
    proc, ports = start_listening("executor_service", ["--device", DEVICE, "--num-gpu-blocks", "16", *TP2], log)
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        pid = worker_pid(log, proc)
        proc.kill()
        proc.wait()
        wait_until(lambda: process_gone(pid), 30.0, "rank 1 to end with rank 0")
    finally:
        stop(proc)


def test_a_hung_rank_ends_the_executor_within_the_collective_timeout(tmp_path: Path) -> None:
    """Rank 1 stopped (SIGSTOP: alive but silent) while the executor is idle: rank 0's heartbeat is not
    answered, and rank 0 exits after --distributed-timeout instead of hanging."""
    log = tmp_path / "executor.log"
    args = ["--device", DEVICE, "--num-gpu-blocks", "16", "--distributed-timeout", "3", *TP2]
    proc, ports = start_listening("executor_service", args, log)
    address = loopback(ports["listen"])
    pid = 0
    try:
        wait_healthy(address, proc)
        pid = worker_pid(log, proc)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert proc.wait(timeout=60) == 1
        assert time.monotonic() - stopped >= 2.0, "rank 0 gave up before the timeout"
        assert "going down" in log.read_text(errors="replace")
    finally:
        if pid and not process_gone(pid):  # rank 0 kills it on the way down; this is for a failed assertion
            os.kill(pid, signal.SIGKILL)
        stop(proc)
