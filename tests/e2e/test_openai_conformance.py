"""Where pagedserve's API differed from vLLM's OpenAI server (issue #35), checked against real processes: a torch
executor on the shipped default model and a scheduler serving gRPC and, without an API key (the default), HTTP.

min_tokens masks EOS and stop tokens in the executor's sampler (also under async scheduling, recompute preemption
and n > 1); the stop token's text stays out of the text unless include_stop_str_in_output (both APIs), and
stop_reason names it; POST routes take application/json only and no CORS header lets a web page in; logprobs 0
includes the sampled token; stream_options, seed, model and response_format follow vLLM's rules.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from client.lib import PagedServeClient
from executor_service.default_model.model import ensure_default_model
from executor_service.model.files import read_json
from tests.support.procs import Stack, run, running_http_stack, running_stack

openai = pytest.importorskip("openai")

MODEL = "default-model-v2"
EXECUTOR = ["--device", "cpu", "--num-gpu-blocks", "256", "--num-cpu-blocks", "0"]
PROMPT = "Once upon a time, there was a little girl named"
QA = "User: What is the capital of France?\nAssistant:"  # greedy: an answer of 14 tokens, then EOS
HELLO = [{"role": "user", "content": "Say hello."}]  # greedy: EOS at once


class HttpStack:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.url = stack.http_url
        self.base_url = f"{self.url}/v1"

    def client(self) -> Any:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    with running_http_stack(tmp_path_factory.mktemp("vllm-api"), EXECUTOR) as s:
        yield HttpStack(s)


@pytest.fixture
async def client(http: HttpStack) -> AsyncIterator[Any]:
    async with http.client() as c:
        yield c


@pytest.fixture(scope="module")
def eos() -> int:
    return int(read_json(ensure_default_model() / "generation_config.json")["eos_token_id"])


async def grpc_run(http: HttpStack, **kwargs: Any) -> tuple[list[int], str, int, str]:
    async with PagedServeClient(http.stack.address) as c:
        return await run(c, **kwargs)


# ---- min_tokens --------------------------------------------------------------------------------------------


async def test_min_tokens_keeps_eos_from_being_sampled_in_chat(client: Any) -> None:
    free = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0)
    assert free.choices[0].message.content == "" and free.usage.completion_tokens == 1  # the model stops at once
    one = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0,
                                               extra_body={"min_tokens": 1})
    assert one.choices[0].message.content.strip(), "EOS was sampled below min_tokens"
    held = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0,
                                                logprobs=True, extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    assert "" not in [e.token for e in held.choices[0].logprobs.content[:3]]  # EOS decodes to ""


async def test_min_tokens_masks_eos_and_greedy_is_unchanged_without_it(http: HttpStack, client: Any,
                                                                       eos: int) -> None:
    free_ids, free_text, _, _ = await grpc_run(http, prompt=QA, max_tokens=40, temperature=0.0)
    assert free_ids[-1] == eos and len(free_ids) == 15, free_ids
    ids, text, _, _ = await grpc_run(http, prompt=QA, max_tokens=40, temperature=0.0, min_tokens=20)
    assert eos not in ids[:20] and len(ids) >= 20
    assert ids[:14] == free_ids[:14] and text.startswith(free_text)
    zero = await grpc_run(http, prompt=QA, max_tokens=40, temperature=0.0, min_tokens=0, stop_token_ids=[free_ids[3]])
    assert zero[0] == free_ids[:4]  # min_tokens 0: the distribution is untouched, the stop token ends it
    completion = await client.completions.create(model=MODEL, prompt=QA, max_tokens=40, temperature=0, logprobs=0,
                                                 extra_body={"min_tokens": 20})
    assert completion.choices[0].text == text and completion.usage.completion_tokens == len(ids)
    assert "" not in completion.choices[0].logprobs.tokens[:20]  # EOS decodes to "" (a special token)


async def test_min_tokens_under_recompute_preemption_async_scheduling_and_n(http: HttpStack, eos: int,
                                                                           tmp_path: Path) -> None:
    """A tight pool (recompute only, async scheduling on) preempts the requests over and over: each is resent as
    new with prompt + outputs, and the executor must count the outputs towards min_tokens. Every sequence (greedy,
    and seeded n = 2) equals the one from the roomy stack, and none has EOS below min_tokens."""
    questions = ["What is the capital of France?", "Why is the sky blue?", "What do bees make?",
                 "How many legs does a spider have?"]
    requests = [dict(prompt=f"User: {q}\nAssistant:", max_tokens=40, min_tokens=24, ignore_eos=False,
                     **(dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=i, n=2)))
                for i, q in enumerate(questions * 2)]

    async def sequences(address: str) -> list[dict[int, list[int]]]:
        async def one(c: PagedServeClient, kwargs: dict[str, Any]) -> dict[int, list[int]]:
            out: dict[int, list[int]] = {}
            async for r in c.generate(**kwargs):
                out.setdefault(r.index, []).extend(r.token_ids)
            return out

        async with PagedServeClient(address) as c:
            return await asyncio.gather(*(one(c, r) for r in requests))

    roomy = await sequences(http.stack.address)
    free, _, _, _ = await grpc_run(http, prompt=requests[0]["prompt"], max_tokens=40, temperature=0.0)
    assert eos in free[:24], "the check needs a request that would sample EOS below min_tokens"
    # 12 sequences (4 greedy, 4 seeded n = 2) of 10-13 prompt tokens, each >= 24 outputs: 3 blocks of 16 by the 21st,
    # so any 5 running together outgrow 14 blocks, and n = 2 pairs run together. Arriving in any order at random steps
    # up to 24 apart (a whole life at 24 tokens) they preempted in each of 150 orders (scripts/arrival_spread.py
    # --prompts 12,11,10,13,12,11,10,13 --n 1,2,1,2,1,2,1,2 --max-tokens 24 --blocks 14).
    tight = ["--device", "cpu", "--num-gpu-blocks", "14", "--num-cpu-blocks", "0"]
    with running_stack(tmp_path, tight) as stack:
        preempted = await sequences(stack.address)
        assert stack.metrics()["vllm:num_preemptions_total"] > 0, "the pool was meant to preempt"
    assert preempted == roomy
    for seqs in roomy:
        for tokens in seqs.values():
            assert len(tokens) >= 24 and eos not in tokens[:24]


# ---- stop tokens and stop strings ---------------------------------------------------------------------------


async def test_the_stop_token_is_in_the_ids_and_usage_not_in_the_text(http: HttpStack, client: Any) -> None:
    free_ids, free_text, _, _ = await grpc_run(http, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                               ignore_eos=True)
    stop = free_ids[2]  # " lived"
    async with PagedServeClient(http.stack.address) as c:
        responses = [r async for r in c.generate(PROMPT, max_tokens=8, temperature=0.0, stop_token_ids=[stop])]
        kept = [r async for r in c.generate(PROMPT, max_tokens=8, temperature=0.0, stop_token_ids=[stop],
                                            include_stop_str_in_output=True)]
    assert [t for r in responses for t in r.token_ids] == free_ids[:3]
    text = "".join(r.text for r in responses)
    assert text == " Ruth who" and free_text.startswith(text + " lived")
    last = responses[-1]
    assert last.usage.completion_tokens == 3 and last.WhichOneof("stop_reason") == "stop_token_id"
    assert last.stop_token_id == stop
    assert "".join(r.text for r in kept) == " Ruth who lived"

    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                 extra_body={"stop_token_ids": [stop]})
    choice = completion.choices[0]
    assert (choice.text, choice.finish_reason, completion.usage.completion_tokens) == (" Ruth who", "stop", 3)
    assert choice.model_extra["stop_reason"] == stop
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                             extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == " Ruth who lived"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


async def test_stop_strings_with_include_stop_str_in_output_and_stop_reason(client: Any) -> None:
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stop=[" lived"])
    kept = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           stop=[" lived"], extra_body={"include_stop_str_in_output": True})
    assert plain.choices[0].text == " Ruth who" and kept.choices[0].text == " Ruth who lived"
    assert plain.choices[0].model_extra["stop_reason"] == kept.choices[0].model_extra["stop_reason"] == " lived"
    chat = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].model_extra["stop_reason"] is None  # EOS


# ---- the request rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
async def test_post_routes_take_json_only(http: HttpStack, path: str, content_type: str | None) -> None:
    """The content types a web page may POST cross-origin without a CORS preflight are refused (415), so a page
    cannot drive a local server that has no API key."""
    body = '{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    headers = {"Origin": "https://evil.example"} | ({"Content-Type": content_type} if content_type else {})
    async with (aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as raw,
                raw.post(http.url + path, data=body.encode(), headers=headers) as r):
        assert r.status == 415
        error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error" and "application/json" in error["message"]
        assert "Access-Control-Allow-Origin" not in r.headers


async def test_json_with_a_charset_is_served_and_no_cors_header_is_sent(http: HttpStack) -> None:
    body = '{"prompt": "hi", "max_tokens": 2}'
    headers = {"Content-Type": "application/json; charset=utf-8", "Origin": "https://evil.example"}
    async with aiohttp.ClientSession() as raw:
        async with raw.post(f"{http.base_url}/completions", data=body, headers=headers) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type"}
        async with raw.options(f"{http.base_url}/completions", headers=preflight) as r:
            assert r.status >= 400 and not any(h.startswith("Access-Control-") for h in r.headers)
    ids, _, _, _ = await grpc_run(http, prompt="hi", max_tokens=2)  # gRPC is another server: unaffected
    assert len(ids) == 2


async def test_logprobs_zero_includes_the_sampled_token(client: Any) -> None:
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                                 logprobs=0, extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]
    sampled = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3,
                                              logprobs=1, extra_body={"ignore_eos": True})
    lp = sampled.choices[0].logprobs  # top-1 plus the sampled token where it is not the top one
    assert all(t in top and 1 <= len(top) <= 2 for t, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    chat = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                                logprobs=True, top_logprobs=0, extra_body={"min_tokens": 3})
    assert [e.top_logprobs for e in chat.choices[0].logprobs.content] == [[], [], []]  # OpenAI's: none asked


async def test_stream_options_need_stream_true(client: Any) -> None:
    for stream in (False, None):
        extra = {} if stream is None else {"stream": stream}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            extra_body={"stream_options": {"include_usage": True}, **extra})
        assert caught.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                             stream_options={"include_usage": True})


async def test_seed_is_a_signed_64_bit_integer(http: HttpStack, client: Any) -> None:
    for seed in (2**63, 2**64 - 1, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=seed)
        assert caught.value.param == "seed"
    for seed in (2**63 - 1, -(2**63)):
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, seed=seed)
    negative = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=-1, temperature=1.0,
                                               extra_body={"ignore_eos": True})
    _, grpc_text, _, _ = await grpc_run(http, prompt=PROMPT, max_tokens=8, seed=2**64 - 1, temperature=1.0,
                                        ignore_eos=True)  # gRPC's uint64 seed: HTTP's -1 is 2^64 - 1 there
    assert negative.choices[0].text == grpc_text


async def test_an_empty_model_name_serves_the_default_model(client: Any) -> None:
    completion = await client.completions.create(model="", prompt=PROMPT, max_tokens=4, temperature=0)
    chat = await client.chat.completions.create(model="", messages=HELLO, max_tokens=4, temperature=0)
    assert completion.model == chat.model == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    error = caught.value.body
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")


async def test_response_format_text_is_accepted_and_unknown_types_refused(client: Any) -> None:
    plain = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                 extra_body={"min_tokens": 6})
    text = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                                response_format={"type": "text"}, extra_body={"min_tokens": 6})
    assert text.choices[0].message.content == plain.choices[0].message.content
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                 extra_body={"response_format": {"type": "text"}})
    assert completion.choices[0].finish_reason == "length"
    for kwargs, param in (({"response_format": {"type": "xml"}}, "response_format"),
                          ({"logit_bias": {"5": 101}}, "logit_bias"), ({"top_logprobs": 2}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **kwargs)
        assert caught.value.param == param and caught.value.body["code"] is None
