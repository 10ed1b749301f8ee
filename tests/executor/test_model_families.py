"""Every supported family beyond Llama: a random-weight directory written by transformers' save_pretrained (tied and
untied embeddings, one sharded), served by the torch backend's real model path with chunked prefill, gives
transformers' greedy tokens for prompts longer than the family's sliding window."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.model import ModelConfig, cpu_ops
from executor_service.model.families import NormLayout, QKNorm
from executor_service.model.moe import SparseMoE
from executor_service.runner.torch_backend import TorchBackend
from executor_service.server import serve
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.executor.test_torch_model import Driver, Seq, assert_same_tokens, hf_greedy, make_prompt
from tests.support.procs import loopback, start_listening, stop, wait_healthy

transformers = pytest.importorskip("transformers")

VOCAB = 384
WINDOW = 16
PROMPT_LENGTHS = (3, 40, 90)  # past the window: the window layers see only its last keys
NEW_TOKENS = 8
CHUNK = 32  # prefill chunks shorter than a prompt: a window reaches back into earlier chunks' blocks
BASE: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "initializer_range": 0.2, "max_position_embeddings": 512,
                        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@dataclass(frozen=True)
class Family:
    config: Callable[..., Any]
    settings: dict[str, Any]
    shard: bool = False  # save in several safetensors files


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
            "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0], "original_max_position_embeddings": 128}

FAMILIES: dict[str, Family] = {
    "mistral": Family(transformers.MistralConfig, {"num_hidden_layers": 2, "head_dim": 16, "sliding_window": WINDOW}),
    "qwen2": Family(transformers.Qwen2Config, {"num_hidden_layers": 2, "use_sliding_window": True,
                                               "sliding_window": WINDOW, "max_window_layers": 0,
                                               "tie_word_embeddings": True}),
    "qwen3": Family(transformers.Qwen3Config, {"num_hidden_layers": 2, "head_dim": 16, "tie_word_embeddings": True}),
    "olmo2": Family(transformers.Olmo2Config, {"num_hidden_layers": 2, "tie_word_embeddings": False}, shard=True),
    "phi3": Family(transformers.Phi3Config, {"num_hidden_layers": 2, "rope_scaling": LONGROPE,
                                             "original_max_position_embeddings": 128,
                                             "sliding_window": WINDOW, "tie_word_embeddings": False}),
    "gemma2": Family(transformers.Gemma2Config, {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": WINDOW,
                                                 "attn_logit_softcapping": 1.0, "final_logit_softcapping": 5.0,
                                                 "query_pre_attn_scalar": 2, "tie_word_embeddings": False}),
    "gemma3": Family(transformers.Gemma3TextConfig, {"num_hidden_layers": 6, "head_dim": 16, "sliding_window": WINDOW,
                                                     "query_pre_attn_scalar": 16,
                                                     "rope_parameters": {
                                                         "full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 100.0}}}),
    "mixtral": Family(transformers.MixtralConfig, {"num_hidden_layers": 2, "num_local_experts": 8,
                                                   "num_experts_per_tok": 2, "intermediate_size": 32,
                                                   "sliding_window": WINDOW}),
    "qwen2_moe": Family(transformers.Qwen2MoeConfig, {"num_hidden_layers": 2, "num_experts": 60,
                                                      "num_experts_per_tok": 4, "moe_intermediate_size": 16,
                                                      "shared_expert_intermediate_size": 48,
                                                      "norm_topk_prob": False, "tie_word_embeddings": True},
                        shard=True),
    "qwen3_moe": Family(transformers.Qwen3MoeConfig, {"num_hidden_layers": 2, "head_dim": 16, "num_experts": 8,
                                                      "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                      "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "gpt_oss": Family(transformers.GptOssConfig, {"num_hidden_layers": 2, "head_dim": 16, "num_local_experts": 8,
                                                  "num_experts_per_tok": 2, "intermediate_size": 32,
                                                  "sliding_window": WINDOW,
                                                  "rope_parameters": {"rope_type": "yarn", "factor": 8.0,
                                                                      "beta_fast": 32.0, "beta_slow": 1.0,
                                                                      "original_max_position_embeddings": 64,
                                                                      "rope_theta": 150000.0, "truncate": False}}),
}


def hf_family_model(path: Path, name: str, seed: int) -> Path:
    family = FAMILIES[name]
    torch.manual_seed(seed)
    config = family.config(**{**BASE, **family.settings})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="200KB" if family.shard else "1GB")
    return path


@dataclass
class Served:
    path: Path
    backend: TorchBackend
    driver: Driver
    hf: Any


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Served]:
    cache: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name not in cache:
            path = hf_family_model(tmp_path_factory.mktemp(name), name, seed=len(cache) + 7)
            # one block table for every layer: these tests drive the model by hand (test_kv_window_groups.py
            # serves the window layers' own tables through the scheduler core)
            backend = TorchBackend.create(ExecutorConfig(model=str(path), device="cpu", block_size=8,
                                                         num_gpu_blocks=128, num_cpu_blocks=32, seed=0,
                                                         kv_window_release=False))
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
            cache[name] = Served(path, backend, Driver(backend), hf)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(served: Callable[[str], Served], name: str) -> None:
    model = served(name)
    seqs = [Seq(f"{name}-{n}", make_prompt(n, seed=n, vocab=VOCAB), n) for n in PROMPT_LENGTHS]
    model.driver.generate(seqs, NEW_TOKENS, chunk=CHUNK)
    for seq in seqs:
        reference = hf_greedy(model.hf, seq.tokens[: seq.num_prompt], NEW_TOKENS)
        assert_same_tokens(seq.tokens[seq.num_prompt :], reference, model.backend.info.eos_token_ids)
        model.driver.release(seq)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_recompute_and_swap_preemption_keep_the_tokens(served: Callable[[str], Served], name: str) -> None:
    """A request preempted by recompute (state dropped, prompt + outputs resent) and one swapped out and back into
    other blocks continue with transformers' tokens."""
    model = served(name)
    backend, driver = model.backend, model.driver
    prompt = make_prompt(45, seed=31, vocab=VOCAB)
    expected = hf_greedy(model.hf, prompt, 12)
    seq = Seq(f"{name}-pre", list(prompt), len(prompt))
    driver.generate([seq], 4, chunk=16)
    driver.release(seq)
    resumed = Seq(f"{name}-pre", list(seq.tokens), len(prompt))
    driver.generate([resumed], 12, chunk=16)
    driver.release(resumed)
    assert_same_tokens(resumed.tokens[len(prompt) :], expected, backend.info.eos_token_ids)
    swapped = Seq(f"{name}-swap", list(prompt), len(prompt))
    driver.generate([swapped], 3)
    old_blocks = list(swapped.blocks)
    cpu_blocks = list(range(len(old_blocks)))
    backend.swap_out(list(zip(old_blocks, cpu_blocks, strict=True)))
    driver.release(swapped)
    backend.kv_cache.device_kv[:, :, old_blocks] = 0.0
    swapped.blocks = [driver.free.pop(0) for _ in old_blocks]
    backend.swap_in(list(zip(cpu_blocks, swapped.blocks, strict=True)))
    driver.generate([swapped], 12)
    driver.release(swapped)
    assert_same_tokens(swapped.tokens[len(prompt) :], expected, backend.info.eos_token_ids)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logprobs_match_transformers(served: Callable[[str], Served], name: str) -> None:
    """The raw log-probabilities after the last prompt token (final soft-capping included) are transformers'."""
    model = served(name)
    prompt = make_prompt(50, seed=99, vocab=VOCAB)
    sampling = SamplingConfig(temperature=0.0, logprobs=5)
    blocks = [model.driver.free.pop() for _ in range(7)]
    out = model.backend.execute([BatchItem(f"lp-{name}", prompt, 50, 0, 50, blocks, True, sampling)])[0]
    model.driver.free.extend(blocks)
    with torch.inference_mode():
        expected = torch.log_softmax(model.hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert out is not None and out.top_logprobs
    assert [t for t, _ in out.top_logprobs] == expected.topk(5).indices.tolist()
    assert [v for _, v in out.top_logprobs] == pytest.approx(expected.topk(5).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bfloat16_logprobs_are_within_tolerance_of_transformers(served: Callable[[str], Served], name: str) -> None:
    """Served in bfloat16 (as these families ship), the log-probabilities of the 20 likeliest tokens after a prompt
    longer than the window are within bfloat16's rounding of transformers' own bfloat16 run."""
    model = served(name)
    backend = TorchBackend.create(ExecutorConfig(model=str(model.path), device="cpu", dtype="bfloat16", block_size=8,
                                                 num_gpu_blocks=16, num_cpu_blocks=0, seed=0, kv_window_release=False))
    assert backend.info.dtype == "bfloat16"
    prompt = make_prompt(50, seed=77, vocab=VOCAB)
    sampling = SamplingConfig(temperature=0.0, logprobs=20)
    out = backend.execute([BatchItem("bf16", prompt, 50, 0, 50, list(range(7)), True, sampling)])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.bfloat16,
                                                            attn_implementation="eager").eval()
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert out is not None and len(out.top_logprobs) == 20
    ours = torch.tensor([v for _, v in out.top_logprobs])
    theirs = expected[[t for t, _ in out.top_logprobs]]
    assert (ours - theirs).abs().max().item() < 0.15  # measured 0.03 - 0.08


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_sparse_moe_experts_are_packed_for_the_fused_cpu_kernel(served: Callable[[str], Served], name: str) -> None:
    """The greedy and logprob tests above then check the fused kernel (csrc/moe_cpu.cpp) against transformers."""
    if not cpu_ops.moe_available():
        pytest.skip("the fused MoE kernel needs AVX-512 and a build")
    moes = [m for m in served(name).backend.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(m.packed is not None for m in moes)
    packed_linears = {id(m) for m in served(name).backend.model.packable_linears()}
    assert not any(id(e.gate_up_proj) in packed_linears for m in moes for e in m.experts)


def test_configs_name_the_family_features(served: Callable[[str], Served]) -> None:
    qwen3 = ModelConfig.from_dir(served("qwen3").path)
    assert qwen3.features.qk_norm == QKNorm.PER_HEAD and qwen3.tie_word_embeddings
    olmo2 = ModelConfig.from_dir(served("olmo2").path)
    assert olmo2.features.qk_norm == QKNorm.WHOLE and olmo2.features.norm_layout == NormLayout.POST
    assert len(list(served("olmo2").path.glob("model-*.safetensors"))) > 1
    phi3 = ModelConfig.from_dir(served("phi3").path)
    assert phi3.rope_scaling is not None and phi3.rope_scaling.rope_type == "longrope"
    assert phi3.rope_scaling.attention_factor > 1.0 and phi3.layer_windows == (WINDOW, WINDOW)
    gemma2 = ModelConfig.from_dir(served("gemma2").path).features
    assert gemma2.layer_windows == (WINDOW, None, WINDOW, None) and gemma2.norm_layout == NormLayout.SANDWICH
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (1.0, 5.0)
    gemma3 = ModelConfig.from_dir(served("gemma3").path).features
    assert gemma3.layer_windows == (WINDOW,) * 5 + (None,) and gemma3.local_rope_theta == 100.0
    mixtral = ModelConfig.from_dir(served("mixtral").path).features.moe
    assert mixtral is not None and (mixtral.num_experts, mixtral.top_k, mixtral.renormalize) == (8, 2, True)
    qwen2_moe = ModelConfig.from_dir(served("qwen2_moe").path).features.moe
    assert qwen2_moe is not None and (qwen2_moe.num_experts, qwen2_moe.top_k) == (60, 4)
    assert not qwen2_moe.renormalize and qwen2_moe.shared_intermediate_size == 48
    qwen3_moe = ModelConfig.from_dir(served("qwen3_moe").path).features.moe
    assert qwen3_moe is not None and qwen3_moe.renormalize and qwen3_moe.sparse_layers == (True, False)
    gpt_oss = ModelConfig.from_dir(served("gpt_oss").path)
    assert gpt_oss.features.attention_sinks and gpt_oss.layer_windows == (WINDOW, None)
    assert gpt_oss.rope_scaling is not None and gpt_oss.rope_scaling.rope_type == "yarn"
    assert gpt_oss.features.moe is not None and gpt_oss.features.moe.swiglu == (1.702, 7.0)


async def greedy_over_grpc(address: str, prompt: list[int]) -> tuple[executor_pb2.DescribeResponse, list[int]]:
    """Describe, then one Execute stream: the prompt's prefill and decode steps, NEW_TOKENS greedy tokens."""
    blocks = list(range(-(-(len(prompt) + NEW_TOKENS) // 8)))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        info = await stub.Describe(executor_pb2.DescribeRequest())
        call = stub.Execute()
        first = executor_pb2.NewRequest(request_id="g", token_ids=prompt, num_prompt_tokens=len(prompt),
                                        num_scheduled_tokens=len(prompt), block_ids=blocks,
                                        sampling=common_pb2.SamplingParams(temperature=0.0))
        await call.write(executor_pb2.StepRequest(step_id=1, new_requests=[first]))
        tokens = list((await call.read()).sampled.token_ids)
        running = executor_pb2.RunningRequests(request_ids=["g"], num_scheduled_tokens=[1], num_new_blocks=[0])
        for step in range(2, NEW_TOKENS + 1):
            await call.write(executor_pb2.StepRequest(step_id=step, running=running))
            result = await call.read()
            assert not result.error and not result.errors
            tokens += list(result.sampled.token_ids)
        await call.done_writing()
    return info, tokens


async def test_a_real_executor_server_describes_and_serves_gemma2(served: Callable[[str], Served]) -> None:
    """Over gRPC: Describe names the architecture and its per-layer windows; an Execute stream of a prefill and
    decode steps gives transformers' greedy tokens for a prompt longer than the window."""
    model = served("gemma2")
    prompt = make_prompt(60, seed=21, vocab=VOCAB)
    server, port = await serve(model.backend, "127.0.0.1:0")
    try:
        info, tokens = await greedy_over_grpc(f"127.0.0.1:{port}", prompt)
    finally:
        await server.stop(None)
    assert info.architecture == "Gemma2ForCausalLM"
    assert list(info.sliding_windows) == [WINDOW, 0, WINDOW, 0]
    assert_same_tokens(tokens, hf_greedy(model.hf, prompt, NEW_TOKENS), model.backend.info.eos_token_ids)


@contextmanager
def tensor_parallel_executor(model: Served, tmp_path: Path) -> Iterator[str]:
    """An executor process serving `model` at --tensor-parallel-size 2; yields its address, stops it cleanly."""
    log = tmp_path / "executor.log"
    proc, ports = start_listening("executor_service", [
        "--model", str(model.path), "--device", "cpu", "--tensor-parallel-size", "2", "--block-size", "8",
        "--num-gpu-blocks", "32", "--num-cpu-blocks", "4", "--no-kv-window-release"], log)
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        yield address
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, Served], str]]:
    """The address of an executor process serving a family at --tensor-parallel-size 2. The last one started is
    kept for the next test of the same family (the prompt-logprobs test follows qwen3's), so one family's
    executor starts once; each is stopped cleanly when another is asked for, or at the module's end."""
    held: dict[str, str] = {}
    with ExitStack() as stack:
        def get(name: str, model: Served) -> str:
            if name not in held:
                stack.close()
                held.clear()
                held[name] = stack.enter_context(tensor_parallel_executor(model, tmp_path_factory.mktemp(f"tp-{name}")))
            return held[name]

        yield get


TP_ORDER = [name for name in FAMILIES if name != "qwen3"] + ["qwen3"]  # qwen3's executor serves the next test too


@pytest.mark.parametrize("name", TP_ORDER)
async def test_tensor_parallel_size_2_gives_the_same_tokens(served: Callable[[str], Served], name: str,
                                                            tensor_parallel: Callable[[str, Served], str]) -> None:
    """`python -m executor_service --tensor-parallel-size 2` (two gloo ranks on the CPU): heads, windows and
    soft-capping per rank (Gemma 2); every expert's and the shared expert's intermediate rows split (Qwen2-MoE);
    the checkpoint's fused qkv and gate/up cut part by part (Phi-3); the q/k norm over all heads all-reduced
    (OLMo 2); sinks per head and the stacked experts' interleaved columns split, the down bias added once
    (GPT-OSS)."""
    model = served(name)
    prompt = make_prompt(50, seed=23, vocab=VOCAB)
    info, tokens = await greedy_over_grpc(tensor_parallel(name, model), prompt)
    assert info.architecture == model.hf.config.architectures[0]
    assert_same_tokens(tokens, hf_greedy(model.hf, prompt, NEW_TOKENS), model.backend.info.eos_token_ids)


async def test_tensor_parallel_prompt_logprobs_equal_one_ranks(served: Callable[[str], Served],
                                                               tensor_parallel: Callable[[str, Served], str]) -> None:
    """Prompt logprobs under tensor parallelism: every rank computes the prompt rows' logprobs in run_batch, in step
    (the rows' logits are gathered from both ranks), from the targets rank 0 packed in the batch; the answer equals
    one rank's."""
    model = served("qwen3")
    prompt = make_prompt(50, seed=29, vocab=VOCAB)
    whole = BatchItem("p", list(prompt), len(prompt), 0, len(prompt), list(range(7)), True,
                      SamplingConfig(temperature=0.0, prompt_logprobs=3))
    model.backend.execute([whole])
    assert whole.prompt_out is not None
    async with grpc.aio.insecure_channel(tensor_parallel("qwen3", model)) as channel:
        call = executor_pb2_grpc.ExecutorStub(channel).Execute()
        await call.write(executor_pb2.StepRequest(step_id=1, new_requests=[executor_pb2.NewRequest(
            request_id="p", token_ids=prompt, num_prompt_tokens=len(prompt), num_scheduled_tokens=len(prompt),
            block_ids=list(range(7)), sampling=common_pb2.SamplingParams(temperature=0.0, prompt_logprobs=3))]))
        result = await call.read()
        await call.done_writing()
    assert not result.error and len(result.prompt_logprobs) == 1
    got = result.prompt_logprobs[0]
    assert got.first_position == whole.prompt_out.first_position == 1
    assert len(got.tokens) == len(whole.prompt_out.tokens) == len(prompt) - 1
    for a, b in zip(got.tokens, whole.prompt_out.tokens, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t for t, _ in b.top_logprobs]


def test_transformers_4x_spellings_read_the_same_features() -> None:
    """Configs as transformers 4.x wrote them (released checkpoints): no layer_types, rope_scaling with "type",
    rope_local_base_freq, sliding_window_pattern, torch_dtype, Phi-3's top-level original_max_position_embeddings."""
    base = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
    gemma2 = ModelConfig.from_dict({**base, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4,
                                    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh",
                                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                                    "query_pre_attn_scalar": 256, "rope_theta": 10000.0})
    assert gemma2.layer_windows == (4096, None, 4096, None) and gemma2.dtype == "bfloat16"
    assert gemma2.features.query_scale == 256**-0.5
    gemma3 = ModelConfig.from_dict({**base, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
                                    "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6,
                                    "rope_local_base_freq": 10000.0, "rope_scaling": None})
    assert gemma3.layer_windows == ((512,) * 5 + (None,)) * 2
    assert gemma3.features.local_rope_theta == 10000.0 and gemma3.rope_theta == 1e6
    phi3 = ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"], "num_hidden_layers": 2,
                                  "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                                  "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                   "long_factor": [4.0] * 8}, "sliding_window": 262144})
    assert phi3.rope_scaling is not None and phi3.rope_scaling.original_max_position_embeddings == 4096
    assert phi3.rope_scaling.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    oss = ModelConfig.from_dict({**base, "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2,
                                 "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
                                 "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 150000,
                                 "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                                  "truncate": False}})
    assert oss.rope_scaling is not None and oss.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    assert oss.layer_windows == (128, None) and oss.features.moe is not None and oss.features.moe.top_k == 4
