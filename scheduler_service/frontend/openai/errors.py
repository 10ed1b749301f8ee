"""OpenAI error objects and the HTTP status of each refusal."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import grpc

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
ERROR_TYPES = {429: "rate_limit_error", 503: "service_unavailable_error"}
"""OpenAI's error types: `invalid_request_error` for what the client got wrong (400, 401, 404, 415, ...),
`server_error` for the rest, and these two where OpenAI's own names vary by cause."""
ERROR_CODES = {429: "rate_limit_exceeded"}
FIELD = re.compile(r"^(?:sampling\.)?([a-z_]+)(?:\.[a-z_]+)*(?:\[\d+\])?: ")
PARAMS = {"prompt_token_ids": "prompt", "request_id": "user"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


@dataclass(slots=True)
class ApiError(Exception):
    """An OpenAI error object: `code` is null unless OpenAI has a code for the case (model_not_found,
    invalid_api_key, rate_limit_exceeded)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status), "param": self.param,
                          "code": self.code or ERROR_CODES.get(self.status)}}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


def from_status(code: grpc.StatusCode, message: str) -> ApiError:
    """A RequestError's status code and message as an OpenAI error; INVALID_ARGUMENT names the parameter."""
    status = HTTP_STATUS.get(code, 500)
    param = None
    match = FIELD.match(message) if status == 400 else None
    if match is not None:
        param = PARAMS.get(match.group(1), match.group(1))
    return ApiError(status, message, param)
