"""Each sampling field's accepted boundary values and its exact error text (the README promises both),
and the request-level checks that run before any tokenization."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from protos.pagedserve.v1 import common_pb2, generation_pb2
from scheduler_service.frontend.validation import (
    MAX_SCANNED_FIELDS,
    InvalidArgument,
    MalformedRequest,
    RequestLimits,
    max_prompt_bytes,
    parse_generate_request,
    sampling_options,
    validate_prompt,
)

LIMITS = RequestLimits(vocab_size=1000, max_model_len=100, max_logprobs=5, max_prompt_bytes=400)


def options(**sampling: Any) -> None:
    req = generation_pb2.GenerateRequest(prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(**sampling))
    sampling_options(req, LIMITS, 2)


ACCEPTED = [
    ("top_p", 1e-9), ("top_p", 0.5), ("top_p", 1.0),
    ("top_k", -1), ("top_k", 0), ("top_k", 1), ("top_k", 50), ("top_k", 2**31 - 1),
    ("min_p", 0.0), ("min_p", 0.5), ("min_p", 1.0),
    ("presence_penalty", -2.0), ("presence_penalty", 0.0), ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0), ("frequency_penalty", 0.0), ("frequency_penalty", 2.0),
    ("repetition_penalty", 1e-6), ("repetition_penalty", 1.0), ("repetition_penalty", 2.0),
    ("temperature", 0.0), ("temperature", 100.0),
    ("priority", -(2**31)), ("priority", 0), ("priority", 2**31 - 1),
    ("logprobs", 0), ("logprobs", 5), ("prompt_logprobs", 0), ("prompt_logprobs", 5),
    ("n", 1), ("n", 16),
    ("max_tokens", 1), ("max_tokens", 98),
]

REFUSED = [
    ("top_p", 0.0, "sampling.top_p: must be in (0, 1], got 0.0"),
    ("top_p", 1.0001, "sampling.top_p: must be in (0, 1], got 1.0001"),
    ("top_k", -2, "sampling.top_k: must be -1 (off), 0 (off) or positive, got -2"),
    ("min_p", -0.001, "sampling.min_p: must be in [0, 1], got -0.001"),
    ("min_p", 1.001, "sampling.min_p: must be in [0, 1], got 1.001"),
    ("presence_penalty", -2.01, "sampling.presence_penalty: must be in [-2, 2], got -2.01"),
    ("presence_penalty", 2.01, "sampling.presence_penalty: must be in [-2, 2], got 2.01"),
    ("frequency_penalty", -2.01, "sampling.frequency_penalty: must be in [-2, 2], got -2.01"),
    ("frequency_penalty", 2.01, "sampling.frequency_penalty: must be in [-2, 2], got 2.01"),
    ("repetition_penalty", 0.0, "sampling.repetition_penalty: must be in (0, 2], got 0.0"),
    ("repetition_penalty", 2.01, "sampling.repetition_penalty: must be in (0, 2], got 2.01"),
    ("temperature", -0.5, "sampling.temperature: must be >= 0, got -0.5"),
    ("temperature", float("inf"), "sampling.temperature: must be a finite number, got inf"),
    ("logprobs", 6, "sampling.logprobs: must be in [0, 5], got 6"),
    ("prompt_logprobs", 6, "sampling.prompt_logprobs: must be in [0, 5], got 6"),
    ("n", 0, "sampling.n: must be in [1, 16], got 0"),
    ("n", 17, "sampling.n: must be in [1, 16], got 17"),
    ("max_tokens", 0, "sampling.max_tokens: must be >= 1, got 0"),
    ("max_tokens", 99, "sampling.max_tokens: prompt (2 tokens) + max_tokens (99) exceeds max_model_len 100; "
                       "allowed range [1, 98]"),
]


@pytest.mark.parametrize(("field", "value"), ACCEPTED)
def test_boundary_values_are_accepted(field: str, value: object) -> None:
    options(**{field: value})


@pytest.mark.parametrize(("field", "value", "message"), REFUSED)
def test_values_past_the_boundary_are_refused_with_the_documented_text(field: str, value: object,
                                                                       message: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        options(**{field: value})
    assert str(refused.value) == message or _float32_close(str(refused.value), message)
    assert refused.value.field == f"sampling.{field}"


def test_prompt_logprobs_are_refused_for_an_executor_that_does_not_compute_them() -> None:
    req = generation_pb2.GenerateRequest(prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(prompt_logprobs=1))
    with pytest.raises(InvalidArgument) as refused:
        sampling_options(req, replace(LIMITS, prompt_logprobs=False), 2)
    assert refused.value.field == "sampling.prompt_logprobs" and "Describe.capabilities" in str(refused.value)


def _float32_close(got: str, want: str) -> bool:
    """float fields are float32 on the wire: 1.0001 arrives as 1.000100016593933."""
    head_got, _, value_got = got.rpartition("got ")
    head_want, _, value_want = want.rpartition("got ")
    return head_got == head_want and abs(float(value_got) - float(value_want)) < 1e-6


def test_an_oversized_prompt_is_refused_before_tokenization() -> None:
    req = generation_pb2.GenerateRequest(prompt="é" * 201)  # 402 bytes
    with pytest.raises(InvalidArgument, match=r"^prompt: 402 bytes is more than max_model_len 100 tokens can hold "
                                              r"\(at most 400 bytes\)$"):
        validate_prompt(req, LIMITS)
    validate_prompt(generation_pb2.GenerateRequest(prompt="é" * 200), LIMITS)


def test_too_many_prompt_token_ids_are_refused_before_the_per_id_checks() -> None:
    with pytest.raises(InvalidArgument, match=r"^prompt_token_ids: 100 tokens; max_model_len is 100$"):
        validate_prompt(generation_pb2.GenerateRequest(prompt_token_ids=[10**6] * 100), LIMITS)
    with pytest.raises(InvalidArgument, match=r"^prompt_token_ids\[1\]: token id 1000 outside"):
        validate_prompt(generation_pb2.GenerateRequest(prompt_token_ids=[1, 1000, 2000]), LIMITS)


def test_the_prompt_byte_limit_follows_max_model_len_and_the_longest_token() -> None:
    assert max_prompt_bytes(8192, 1, 4 << 20) == 8192
    assert max_prompt_bytes(8192, 14, 4 << 20) == 8192 * 14
    assert max_prompt_bytes(1 << 20, 14, 4 << 20) == 4 << 20


def test_invalid_utf8_names_its_field() -> None:
    good = generation_pb2.GenerateRequest(prompt="ab", request_id="r",
                                          sampling=common_pb2.SamplingParams(stop=["xy"]))
    data = good.SerializeToString()
    bad_prompt = data.replace(b"ab", b"a\xff")
    bad_stop = data.replace(b"xy", b"\xc3(")
    assert parse_generate_request(data) == good
    for body, field in ((bad_prompt, "prompt"), (bad_stop, "sampling.stop")):
        parsed = parse_generate_request(body)
        assert isinstance(parsed, MalformedRequest)
        assert str(parsed.error) == f"{field}: not valid UTF-8"
    garbage = parse_generate_request(b"\x12\xff\xff\xff")
    assert isinstance(garbage, MalformedRequest) and garbage.error.field == "request"


@pytest.mark.parametrize("unknown", [
    b"\x3b\x3c",  # an empty group, field 7 (wire types 3 and 4)
    b"\x3b\x08\x01\x12\x02hi\x43\x44\x3c",  # a group holding a varint, a string and a group
    b"\x39" + b"\x00" * 8,  # fixed64
])
def test_invalid_utf8_is_named_after_unknown_fields_of_any_wire_type(unknown: bytes) -> None:
    """An unknown group before a bad prompt made the UTF-8 scan give up: "request: not a valid GenerateRequest"."""
    body = unknown + generation_pb2.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"a\xff")
    parsed = parse_generate_request(body)
    assert isinstance(parsed, MalformedRequest) and str(parsed.error) == "prompt: not valid UTF-8"


def test_unknown_groups_nested_past_the_limit_unclosed_or_past_the_budget_are_a_malformed_request() -> None:
    bad_prompt = generation_pb2.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"a\xff")
    many = b"\x3b\x3c" * (MAX_SCANNED_FIELDS // 2)  # past the scan's budget: it gives up (4 MB of them: 4 s)
    varints = b"\x38\x01" * MAX_SCANNED_FIELDS
    for unknown in (b"\x3b" * 10_000 + b"\x3c" * 10_000, b"\x3b\x08\x01", b"\x3b\x44", many, varints):
        parsed = parse_generate_request(unknown + bad_prompt)
        assert isinstance(parsed, MalformedRequest) and parsed.error.field == "request"


def test_a_cache_salt_must_be_non_empty_and_bounded() -> None:
    """GenerateRequest.cache_salt (#27): unset or 1 to MAX_CACHE_SALT_LEN characters."""
    from scheduler_service.frontend.validation import MAX_CACHE_SALT_LEN

    for salt in ("x", "s" * MAX_CACHE_SALT_LEN):
        validate_prompt(generation_pb2.GenerateRequest(prompt_token_ids=[5], cache_salt=salt), LIMITS)
    for salt in ("", "s" * (MAX_CACHE_SALT_LEN + 1)):
        with pytest.raises(InvalidArgument) as err:
            validate_prompt(generation_pb2.GenerateRequest(prompt_token_ids=[5], cache_salt=salt), LIMITS)
        assert err.value.field == "cache_salt"


def test_a_tenant_is_a_keyed_digest_of_the_api_key_never_the_key() -> None:
    """TenantScope (#27): the same key under the same secret is the same tenant (every api server of a service
    shares the secret); other keys, or the same key under another service's secret, are other tenants; no key,
    no tenant; the key does not appear in what the engine core is sent."""
    from scheduler_service.frontend.auth import TenantScope

    secret = b"s" * 32
    one, again, other = TenantScope(secret), TenantScope(secret), TenantScope(b"t" * 32)
    alpha = one.of("alpha-key")
    assert alpha == again.of("alpha-key") and len(alpha) == 32
    assert alpha != one.of("beta-key") and alpha != other.of("alpha-key")
    assert "alpha" not in alpha and one.of("") == ""
    assert TenantScope().of("alpha-key") != TenantScope().of("alpha-key")  # a random secret per service
