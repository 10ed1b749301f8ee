"""Prompt logprobs (#30) through real processes: a torch executor on the default model (float32, CPU) with a small KV
cache and a scheduler whose chunked prefill is forced small (16 tokens a step), so that every prompt here is computed
in several chunks and concurrent requests preempt each other by recompute.

Each prompt position's logprob (and its top alternatives) equals transformers' log_softmax of the logits at the
position before it, within 1e-4; with a cached prefix of the same prompt available (the request must compute it, not
find it); under recompute preemption (delivered once, complete); over gRPC (`prompt_logprobs`) and through the
official `openai` client (`echo` with `logprobs`, vLLM's `prompt_logprobs`), streamed and not; bad values are refused
naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from client.lib import PagedServeClient
from executor_service.default_model.model import ensure_default_model
from protos.pagedserve.v1 import generation_pb2
from tests.support.procs import Stack, running_http_stack

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

MODEL = "default-model-v2"
EXECUTOR = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "24", "--num-cpu-blocks", "0"]
SCHEDULER = ["--enable-chunked-prefill", "--max-num-batched-tokens", "16", "--preemption-mode", "recompute"]
TOLERANCE = 1e-4
K = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    with running_http_stack(tmp_path_factory.mktemp("prompt-logprobs"), EXECUTOR, SCHEDULER) as s:
        yield s, f"{s.http_url}/v1"


@pytest.fixture(scope="module")
def hf() -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


@pytest.fixture
async def client(stack: tuple[Stack, str]) -> AsyncIterator[Any]:
    async with openai.AsyncOpenAI(base_url=stack[1], api_key="unused", max_retries=0) as c:
        yield c


def make_prompt(length: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + 17 * i + i * i) % 1900 for i in range(length)]


def hf_prompt_logprobs(hf: Any, prompt: list[int]) -> Any:
    """transformers' log_softmax over the vocabulary at each prompt position (row p: the distribution of token
    p + 1)."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(hf: Any, prompt: list[int], entries: list[Any]) -> None:
    """gRPC TokenLogprobs of positions 1 .. P-1 against transformers: the token, its logprob, the top K."""
    expected = hf_prompt_logprobs(hf, prompt)
    assert len(entries) == len(prompt) - 1
    for q, entry in enumerate(entries, start=1):
        row = expected[q - 1]
        assert entry.token_id == prompt[q]
        assert abs(entry.logprob - float(row[prompt[q]])) < TOLERANCE, (q, entry.logprob, float(row[prompt[q]]))
        values = row.topk(K).values.tolist()
        got = [t.logprob for t in entry.top]
        assert len(got) == K and all(abs(a - b) < TOLERANCE for a, b in zip(got, values, strict=True)), (q, got)
        for t in entry.top:
            assert abs(t.logprob - float(row[t.token_id])) < TOLERANCE


async def generate(address: str, prompt: list[int], **sampling: Any) -> list[generation_pb2.GenerateResponse]:
    async with PagedServeClient(address) as c:
        return [r async for r in c.generate(prompt_token_ids=prompt, temperature=0.0, **sampling)]


def prompt_entries(responses: list[generation_pb2.GenerateResponse]) -> list[Any]:
    """The prompt logprobs of a call, which must come exactly once, in its first response."""
    carrying = [i for i, r in enumerate(responses) if r.prompt_logprobs]
    assert carrying == [0], f"prompt logprobs in responses {carrying}, expected the first only"
    return list(responses[0].prompt_logprobs)


async def test_prompt_logprobs_equal_transformers_over_chunks(stack: tuple[Stack, str], hf: Any) -> None:
    prompt = make_prompt(45, seed=1)  # three 16-token chunks
    responses = await generate(stack[0].address, prompt, max_tokens=3, prompt_logprobs=K)
    assert list(responses[0].prompt_token_ids) == prompt
    check_against_hf(hf, prompt, prompt_entries(responses))
    assert sum(len(r.token_ids) for r in responses) == 3
    plain = await generate(stack[0].address, prompt, max_tokens=3)
    assert not any(r.prompt_logprobs for r in plain), "a request that did not ask gets none"
    assert [t for r in plain for t in r.token_ids] == [t for r in responses for t in r.token_ids]


async def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(stack: tuple[Stack, str], hf: Any) -> None:
    s = stack[0]
    prompt = make_prompt(40, seed=2)
    await generate(s.address, prompt, max_tokens=1)  # its full blocks are now cached
    before = s.metrics()
    await generate(s.address, prompt, max_tokens=1)
    hits = s.metrics()
    assert hits["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"], "the prefix is cached"
    responses = await generate(s.address, prompt, max_tokens=2, prompt_logprobs=K)
    assert s.metrics()["vllm:prefix_cache_hits_total"] == hits["vllm:prefix_cache_hits_total"], \
        "a request asking for prompt logprobs takes no cache hit"
    check_against_hf(hf, prompt, prompt_entries(responses))


async def test_prompt_logprobs_come_once_and_whole_under_recompute_preemption(stack: tuple[Stack, str],
                                                                            hf: Any) -> None:
    s = stack[0]
    # 17 prompt blocks of 16, 34 by the last token (6 x 48 outputs): 24 blocks hold about four at their end. Arriving in
    # any order at random steps up to 32 apart (two thirds of a life) they preempted in each of 150 orders
    # (scripts/arrival_spread.py --prompts 30,33,36,39,42,45 --max-tokens 48 --blocks 24 --max-num-batched-tokens 16).
    prompts = [make_prompt(30 + 3 * i, seed=10 + i) for i in range(6)]
    before = s.metrics()["vllm:num_preemptions_total"]
    calls = [generate(s.address, p, max_tokens=48, ignore_eos=True, prompt_logprobs=K) for p in prompts]
    results = await asyncio.gather(*calls)
    assert s.metrics()["vllm:num_preemptions_total"] > before, "the batch was meant to preempt"
    for prompt, responses in zip(prompts, results, strict=True):
        check_against_hf(hf, prompt, prompt_entries(responses))
        assert sum(len(r.token_ids) for r in responses) == 48


async def test_bad_prompt_logprobs_are_refused_naming_the_field(stack: tuple[Stack, str], client: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(stack[0].address, [5, 6, 7], max_tokens=1, prompt_logprobs=21)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs" in (caught.value.details() or "")
    bodies: list[tuple[dict[str, Any], str]] = [({"prompt_logprobs": 21}, "prompt_logprobs"),
                                                ({"prompt_logprobs": -1}, "prompt_logprobs"),
                                                ({"prompt_logprobs": "all"}, "prompt_logprobs")]
    for extra, param in bodies:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt="a b", max_tokens=1, extra_body=extra)
        assert bad.value.body["param"] == param, bad.value.body
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="a b", max_tokens=1, echo=True, logprobs=21)
    assert bad.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert bad.value.body["param"] == "prompt_logprobs"


async def test_echo_with_logprobs_leads_with_the_prompt_through_the_openai_client(client: Any, hf: Any) -> None:
    prompt = make_prompt(33, seed=3)
    expected = hf_prompt_logprobs(hf, prompt)
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2)
    plain = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    lp, done = whole.choices[0].logprobs, plain.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 4 and lp.tokens[len(prompt):] == done.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for q in range(1, len(prompt)):
        assert abs(lp.token_logprobs[q] - float(expected[q - 1][prompt[q]])) < TOLERANCE
        assert 1 <= len(lp.top_logprobs[q]) <= 3  # the top 2 and the prompt token
    assert lp.token_logprobs[len(prompt):] == done.token_logprobs
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    prompt_chars = sum(len(t) for t in lp.tokens[:len(prompt)])
    assert lp.text_offset[len(prompt):] == [prompt_chars + o for o in done.text_offset]
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                             logprobs=2, stream=True)
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            for key in streamed:
                streamed[key] += getattr(choice.logprobs, key) if choice.logprobs else []
    assert text == whole.choices[0].text
    assert streamed == {key: getattr(lp, key) for key in streamed}


async def test_vllm_prompt_logprobs_on_completions(client: Any, hf: Any) -> None:
    prompt = make_prompt(20, seed=4)
    expected = hf_prompt_logprobs(hf, prompt)
    for stream in (False, True):
        answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, n=2,
                                                 stream=stream, extra_body={"prompt_logprobs": 1})
        if stream:
            chunks = [c async for c in answer]
            got = {c.choices[0].index: c.choices[0].model_extra["prompt_logprobs"] for c in chunks
                   if c.choices and (c.choices[0].model_extra or {}).get("prompt_logprobs")}
        else:
            got = {c.index: c.model_extra["prompt_logprobs"] for c in answer.choices}
        assert sorted(got) == [0, 1], "every choice of the prompt carries them"
        for entries in got.values():
            assert entries[0] is None and len(entries) == len(prompt)
            for q in range(1, len(prompt)):
                mine = entries[q][str(prompt[q])]
                assert abs(mine["logprob"] - float(expected[q - 1][prompt[q]])) < TOLERANCE
                best = int(expected[q - 1].argmax())
                assert str(best) in entries[q] and entries[q][str(best)]["rank"] == 1
