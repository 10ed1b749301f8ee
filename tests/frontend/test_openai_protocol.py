"""OpenAI request bodies to GenerateRequests, and refusals to OpenAI errors, without servers."""

from __future__ import annotations

import grpc
import pytest

from scheduler_service.frontend.openai.chat import ChatTemplate
from scheduler_service.frontend.openai.errors import ApiError, from_status
from scheduler_service.frontend.openai.protocol import parse_chat, parse_completion


def test_completion_body_maps_every_sampling_parameter() -> None:
    api = parse_completion({
        "model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1,
        "n": 2, "stop": "x", "seed": -1, "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [7], "stream": True,
        "stream_options": {"include_usage": True}})
    s = api.sampling
    assert (s.max_tokens, s.top_k, s.n, list(s.stop), s.seed, s.logprobs, s.min_tokens) == (5, 4, 2, ["x"], 2**64 - 1,
                                                                                              3, 2)
    assert (s.temperature, s.top_p, s.min_p, s.repetition_penalty) == pytest.approx((0.5, 0.9, 0.1, 1.2))
    assert s.ignore_eos and list(s.stop_token_ids) == [7] and api.stream and api.include_usage
    assert api.prompts == ["hi"] and api.logprobs == 3


@pytest.mark.parametrize(("prompt", "expected"), [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt: object, expected: list[object]) -> None:
    assert parse_completion({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"), ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "stop": [1]}, "stop"), ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "logit_bias": {"1": 2}}, "logit_bias"), ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
])
def test_bad_bodies_name_the_parameter(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_completion(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_chat_body_flattens_text_parts_and_maps_logprobs() -> None:
    api, messages, kwargs = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}],
                                        "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 9})
    assert messages == [{"role": "user", "content": "ab"}]
    assert api.sampling.logprobs == 2 and api.sampling.max_tokens == 9 and kwargs["add_generation_prompt"]


@pytest.mark.parametrize(("code", "message", "status", "param"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1], got 0", 400, "top_p"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[3]: token id 9999 outside", 400, "prompt"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full", 429, None),
    (grpc.StatusCode.UNAVAILABLE, "server is shutting down", 503, None),
    (grpc.StatusCode.INTERNAL, "boom", 500, None),
])
def test_status_codes_map_to_http(code: grpc.StatusCode, message: str, status: int, param: str | None) -> None:
    error = from_status(code, message)
    assert (error.status, error.param) == (status, param)
    assert error.body()["error"]["message"] == message


def test_chat_template_renders_with_special_tokens_and_refuses_politely() -> None:
    template = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}", {"bos_token": "<s>"})
    text = template.render([{"role": "user", "content": "hi"}], {"add_generation_prompt": True})
    assert text == "<s>user: hi\nassistant:"
    strict = ChatTemplate("{{ raise_exception('only one message') }}", {})
    with pytest.raises(ApiError) as caught:
        strict.render([], {})
    assert caught.value.status == 400 and "only one message" in caught.value.message


def test_cache_salt_is_read_from_both_bodies_and_must_be_a_non_empty_string() -> None:
    """vLLM's cache_salt (#27): a non-empty string on completions and chat, carried into the GenerateRequest."""
    from scheduler_service.frontend.openai.app import generate_request

    api = parse_completion({"prompt": "hi", "cache_salt": "s1"})
    assert api.cache_salt == "s1" and generate_request("r", "hi", api).cache_salt == "s1"
    chat, _, _ = parse_chat({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "s2"})
    assert chat.cache_salt == "s2" and generate_request("r", [1], chat).cache_salt == "s2"
    plain = parse_completion({"prompt": "hi"})
    assert plain.cache_salt is None and not generate_request("r", "hi", plain).HasField("cache_salt")
    for bad in ("", 5, ["s"]):
        with pytest.raises(ApiError) as err:
            parse_completion({"prompt": "hi", "cache_salt": bad})
        assert err.value.status == 400 and err.value.param == "cache_salt"
        with pytest.raises(ApiError):
            parse_chat({"messages": [{"role": "user", "content": "hi"}], "cache_salt": bad})
