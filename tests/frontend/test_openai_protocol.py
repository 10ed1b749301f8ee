"""OpenAI request bodies to GenerateRequests, and refusals to OpenAI errors, without servers."""

from __future__ import annotations

import json

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
    ({"prompt": "a", "stop": [1]}, "stop"), ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "logit_bias": {"x": 2}}, "logit_bias"), ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "logit_bias": {"1": "2"}}, "logit_bias"), ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "logit_bias": {"9" * 5000: 1}}, "logit_bias"), ({"prompt": "a", "logit_bias": {"\u00b2": 1}},
                                                                      "logit_bias"),
    ({"prompt": "a", "logit_bias": {"4294967296": 1}}, "logit_bias"),
    ({"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"prompt": "a", "structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"prompt": "a", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
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


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    ({"prompt": "a", "seed": 2**63}, "seed"),
    ({"prompt": "a", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "a", "response_format": "text"}, "response_format"),
    ({"prompt": "a", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_vllm_request_rules(body: dict[str, object], param: str) -> None:
    """vLLM's (and OpenAI's) rules: stream_options only with stream true; a signed 64-bit seed; response_format
    an object."""
    with pytest.raises(ApiError) as caught:
        parse_completion(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_what_vllm_accepts() -> None:
    api = parse_completion({"prompt": "a", "model": "", "seed": 2**63 - 1, "stream_options": None,
                            "response_format": {"type": "text"}, "include_stop_str_in_output": True})
    assert api.model is None and api.sampling.seed == 2**63 - 1 and api.sampling.include_stop_str_in_output
    assert parse_completion({"prompt": "a", "seed": -(2**63)}).sampling.seed == 2**63  # two's complement
    assert not parse_completion({"prompt": "a", "stream_options": {}}).include_usage
    chat, _, _ = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 0})
    assert chat.logprobs == 0
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert caught.value.param == "top_logprobs"


@pytest.mark.parametrize(("error", "kind", "code"), [
    (ApiError(400, "max_tokens: bad", "max_tokens"), "invalid_request_error", None),
    (ApiError(401, "no key", code="invalid_api_key"), "invalid_request_error", "invalid_api_key"),
    (ApiError(404, "The model `x` does not exist.", "model", "model_not_found"), "invalid_request_error",
     "model_not_found"),
    (ApiError(405, "Method Not Allowed"), "invalid_request_error", None),
    (ApiError(415, "Unsupported Media Type"), "invalid_request_error", None),
    (ApiError(429, "queue full"), "rate_limit_error", "rate_limit_exceeded"),
    (ApiError(500, "boom"), "server_error", None),
    (ApiError(503, "later"), "service_unavailable_error", None),
])
def test_error_objects_have_openai_types_and_codes(error: ApiError, kind: str, code: str | None) -> None:
    body = error.body()["error"]
    assert (body["type"], body["code"], body["param"]) == (kind, code, error.param)


@pytest.mark.parametrize(("name", "value"), [
    ("skip_special_tokens", False), ("use_beam_search", True), ("continue_final_message", True),
    ("truncate_prompt_tokens", 5), ("allowed_token_ids", [1]), ("bad_words", ["x"]), ("prompt_logprobs", 0),
])
def test_vllm_extensions_that_change_the_output_are_refused_unless_at_their_default(name: str, value: object) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": messages, name: value})
    assert caught.value.param == name
    parse_chat({"messages": messages, "skip_special_tokens": True, "echo": False, "bad_words": [],
                "truncate_prompt_tokens": None})


def test_constraints_and_logit_bias_are_read_into_the_sampling_params() -> None:
    """#30: response_format (json_object, json_schema), vLLM's structured_outputs and guided_*, logit_bias."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert json.loads(parse_completion({"prompt": "a", "response_format": fmt}).sampling.structured_outputs.json
                      ) == schema
    assert parse_completion({"prompt": "a", "response_format": {"type": "json_object"}}
                            ).sampling.structured_outputs.json_object
    so = parse_chat({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"choice": ["x", "y"]}}
                    )[0].sampling.structured_outputs
    assert list(so.choice) == ["x", "y"]
    assert parse_completion({"prompt": "a", "guided_regex": "[ab]+"}).sampling.structured_outputs.regex == "[ab]+"
    assert parse_completion({"prompt": "a", "structured_outputs": {"json": schema}}
                            ).sampling.structured_outputs.json == json.dumps(schema)
    assert not parse_completion({"prompt": "a", "response_format": {"type": "text"}}).sampling.HasField(
        "structured_outputs")
    assert dict(parse_completion({"prompt": "a", "logit_bias": {"5": -3, "7": 100}}).sampling.logit_bias) == {
        5: -3.0, 7: 100.0}


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
