"""The OpenAI-compatible HTTP API, through the official `openai` client, against real processes: a torch executor
serving the shipped default model and a scheduler with --http-listen and an API key.

Greedy text over HTTP equals the gRPC path's and transformers' for the same prompt; the chat endpoint renders the
model's chat template as transformers does; n > 1, stop strings, logprobs, usage and streaming (with
include_usage) have OpenAI's shapes; a client that goes away aborts its request and frees its blocks; refusals
carry OpenAI error objects with the right HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from client.bench.datasets import SyntheticConfig, synthetic_requests
from client.lib import PagedServeClient
from executor_service.default_model.model import ensure_default_model
from tests.support.procs import (
    ROOT,
    Stack,
    refusing_address,
    run,
    running_http_stack,
    start_listening,
    stop,
    wait_until,
)

openai = pytest.importorskip("openai")
OpenAIClient = Any  # openai.AsyncOpenAI; the test reads its responses loosely, as JSON
transformers = pytest.importorskip("transformers")

KEY = "test-key-15"
MODEL = "default-model-v2"
PROMPT = "Once upon a time, there was a little girl named"
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
EXECUTOR = ["--device", "cpu", "--num-gpu-blocks", "256", "--num-cpu-blocks", "0"]


class HttpStack:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.base_url = f"{stack.http_url}/v1"

    def client(self, api_key: str = KEY, **kwargs: Any) -> OpenAIClient:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    with running_http_stack(tmp_path_factory.mktemp("openai"), EXECUTOR, ["--api-key", KEY]) as stack:
        yield HttpStack(stack)


@pytest.fixture
async def client(http: HttpStack) -> AsyncIterator[OpenAIClient]:
    async with http.client() as c:
        yield c


@pytest.fixture(scope="module")
def hf() -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(ensure_default_model())


def hf_greedy_text(hf: Any, tokenizer: Any, ids: list[int], max_new: int) -> str:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


async def test_models_lists_the_served_model(client: OpenAIClient) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_greedy_completion_equals_grpc_and_transformers(http: HttpStack, client: OpenAIClient,
                                                              hf: Any, hf_tokenizer: Any) -> None:
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    text = completion.choices[0].text
    async with PagedServeClient(http.stack.address, api_key=KEY) as grpc_client:
        _, grpc_text, _, _ = await run(grpc_client, prompt=PROMPT, max_tokens=40, temperature=0.0)
    assert text == grpc_text
    ids = [hf_tokenizer.bos_token_id, *hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]]
    assert text == hf_greedy_text(hf, hf_tokenizer, ids, 40)
    assert completion.usage.prompt_tokens == len(ids)
    assert completion.usage.completion_tokens + completion.usage.prompt_tokens == completion.usage.total_tokens
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert len(text.split()) >= 5, f"the trained model should write words, got {text!r}"


async def test_streamed_completion_matches_and_reports_usage(client: OpenAIClient) -> None:
    whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_token_id_prompts_and_lists_of_prompts(client: OpenAIClient, hf_tokenizer: Any) -> None:
    ids = [hf_tokenizer.bos_token_id, *hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]]
    by_text = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    both = await client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=12, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + 4  # token-id prompts are taken as they are (no BOS added)


async def test_n_seeded_choices(client: OpenAIClient) -> None:
    first = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, n=3, seed=7,
                                            temperature=1.0, extra_body={"ignore_eos": True})
    again = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, n=3, seed=7,
                                            temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 48


async def test_stop_string_ends_the_text(client: OpenAIClient) -> None:
    free = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    text = free.choices[0].text
    words = text.split()
    stop = f" {words[3]}"
    stopped = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                              stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


async def test_completion_logprobs(client: OpenAIClient) -> None:
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                 logprobs=3, extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == completion.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert top[token] == pytest.approx(logprob, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


async def test_chat_completion_renders_the_template_like_transformers(http: HttpStack, client: OpenAIClient,
                                                                      hf_tokenizer: Any) -> None:
    chat = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    ids = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    async with PagedServeClient(http.stack.address, api_key=KEY) as grpc_client:
        _, expected, _, _ = await run(grpc_client, prompt_token_ids=list(ids), max_tokens=40, temperature=0.0)
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == expected
    assert chat.usage.prompt_tokens == len(ids)
    assert "blue" in message.content, f"the trained model should answer its training question: {message.content!r}"


async def test_streamed_chat_with_logprobs(client: OpenAIClient) -> None:
    whole = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0)
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0,
                                                  stream=True, logprobs=True, top_logprobs=2,
                                                  stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


async def test_disconnected_stream_is_aborted_and_frees_blocks(http: HttpStack, client: OpenAIClient) -> None:
    before = http.stack.metrics().get("vllm:request_success_total{abort}", 0)
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=900, stream=True,
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    assert http.stack.metrics()["pagedserve:device_blocks_used"] > 0
    await stream.close()
    wait_until(http.stack.idle, what="the aborted request to free its blocks")
    assert http.stack.metrics()["vllm:request_success_total{abort}"] == before + 1


async def test_disconnected_plain_request_is_aborted(http: HttpStack) -> None:
    before = http.stack.metrics().get("vllm:request_success_total{abort}", 0)
    async with http.client(timeout=1.0) as impatient:
        with pytest.raises(openai.APITimeoutError):
            await impatient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=900,
                                               extra_body={"ignore_eos": True})
    wait_until(lambda: http.stack.metrics().get("vllm:request_success_total{abort}", 0) == before + 1,
               what="the abandoned request to be aborted")
    wait_until(http.stack.idle, what="its blocks to be freed")


# A prefill that takes about a minute: the simulated executor spends 1 s a step and the scheduler computes 16
# prompt tokens a step, so a prompt of 800+ tokens has its first token after 50+ steps.
SLOW_STEP_S, SLOW_CHUNK, LONG_PROMPT = 1.0, 16, 800
ABORT_WITHIN_S = 20.0  # well before the first token could come


@pytest.fixture(scope="module")
def slow_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    executor = ["--simulated", "--sim-step-latency-ms", str(int(SLOW_STEP_S * 1000)), "--num-gpu-blocks", "512"]
    scheduler = ["--api-key", KEY, "--tokenizer", str(ensure_default_model()), "--max-num-batched-tokens",
                 str(SLOW_CHUNK)]
    with running_http_stack(tmp_path_factory.mktemp("slow-prefill"), executor, scheduler) as stack:
        yield HttpStack(stack)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_disconnected_before_its_first_token_is_aborted_and_frees_blocks(
        slow_prefill: HttpStack, path: str) -> None:
    """The client goes away while its request is in a long prefill: nothing was written to it yet (the
    headers go with the first token), so only the server noticing the closed connection can abort it."""
    stack = slow_prefill.stack
    body: dict[str, Any] = {"max_tokens": 8, "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": " ".join(f"word{i}" for i in range(LONG_PROMPT))}]
    else:
        body["prompt"] = [3 + i % 1000 for i in range(LONG_PROMPT)]
    data = json.dumps(body).encode()
    before = stack.metrics()
    aborted = before.get("vllm:request_success_total{abort}", 0)
    first_tokens = before.get("vllm:time_to_first_token_seconds_count", 0)
    port = int(slow_prefill.base_url.split(":")[-1].split("/")[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()

    def prefilling() -> bool:
        m = stack.metrics()
        return m["vllm:num_requests_running"] == 1 and m["pagedserve:device_blocks_used"] >= LONG_PROMPT // 16

    wait_until(prefilling, what="the request to be running with its prompt's blocks")
    assert stack.metrics().get("vllm:time_to_first_token_seconds_count", 0) == first_tokens
    writer.close()
    await writer.wait_closed()
    wait_until(lambda: stack.metrics().get("vllm:request_success_total{abort}", 0) == aborted + 1,
               timeout=ABORT_WITHIN_S, what="the disconnected request to be aborted in the core")
    wait_until(stack.idle, timeout=ABORT_WITHIN_S, what="its blocks to be freed")
    after = stack.metrics()
    assert after["pagedserve:device_blocks_used"] == 0 and after["vllm:num_requests_running"] == 0
    assert after.get("vllm:time_to_first_token_seconds_count", 0) == first_tokens  # it never had one
    assert await reader.read() == b""  # nothing was ever sent to the client


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"n": "three"}, "n"),
    ({"extra_body": {"min_tokens": 50}, "max_tokens": 10}, "min_tokens"),
    ({"logprobs": 99}, "logprobs"),
])
async def test_bad_parameters_are_400_naming_the_parameter(client: OpenAIClient, kwargs: dict[str, Any],
                                                           param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.param == param and param in caught.value.message


async def test_prompt_of_wrong_type_is_400(client: OpenAIClient) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt=[["a"]])
    assert caught.value.param == "prompt"


async def test_unknown_model_is_404(client: OpenAIClient) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert caught.value.code == "model_not_found"


async def test_missing_or_wrong_key_is_401(http: HttpStack) -> None:
    async with http.client(api_key="wrong") as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
    async with aiohttp.ClientSession() as raw:
        async with raw.get(f"{http.base_url}/models") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        async with raw.get(http.base_url.removesuffix("/v1") + "/health") as r:
            assert r.status == 200


async def test_queue_full_is_429_and_no_executor_is_503(tmp_path: Path) -> None:
    with running_http_stack(tmp_path, ["--simulated"], ["--max-queue-len", "0"]) as stack:
        async with openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.RateLimitError) as caught:
                await c.completions.create(model="simulated", prompt="hello")
            assert "queue is full" in caught.value.message
    with refusing_address() as dead:
        lonely, ports = start_listening("scheduler_service", ["--executor", dead, "--metrics-port", "-1",
                                                              "--http-listen", "127.0.0.1:0"],
                                        tmp_path / "lonely.log", ("listen", "http_listen"))
        await answers_503_without_executor(lonely, f"http://127.0.0.1:{ports['http_listen']}")


async def answers_503_without_executor(lonely: subprocess.Popen[bytes], url: str) -> None:
    try:
        async with aiohttp.ClientSession() as raw:
            assert await wait_for_status(raw, f"{url}/health") == 503
            async with raw.post(f"{url}/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["type"] == "service_unavailable_error"
    finally:
        stop(lonely)


async def wait_for_status(client: aiohttp.ClientSession, url: str) -> int:
    """The status of GET url once the server listens (it is starting up)."""
    for _ in range(600):
        try:
            async with client.get(url) as r:
                return r.status
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    raise TimeoutError(url)


def test_bench_over_http_sends_the_same_requests(http: HttpStack, tmp_path: Path) -> None:
    result_json = tmp_path / "http.json"
    args = ["--num-prompts", "6", "--synthetic-input-mean", "16", "--synthetic-output-mean", "8",
            "--synthetic-vocab-size", "2048", "--ignore-eos", "--disable-tqdm", "--api-key", KEY]
    proc = subprocess.run([sys.executable, "-m", "client", "bench", "--backend", "openai", "--base-url",
                           http.base_url.removesuffix("/v1"), "--result-json", str(result_json), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(result_json.read_text())
    expected = synthetic_requests(SyntheticConfig(num_prompts=6, input_mean=16, output_mean=8, vocab_size=2048))
    assert (result["completed"], result["failed"], result["backend"]) == (6, 0, "openai")
    assert result["output_lens"] == [r.max_tokens for r in expected]
    assert result["mean_ttft_ms"] > 0
