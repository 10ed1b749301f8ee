"""A client's resume point (GenerateRequest.resume, #28): the sequences of a call it lost, continued after the
tokens it has. Each listed sequence becomes a request that already has those output tokens (the engine computes
them as it does a recompute-preempted request's: same ids, positions and seeds); finished ones are not run; the
front-end replays the tokens through the sequence's detokenizer and stop matcher so text and stop strings
continue where the lost front-end left them."""

from __future__ import annotations

from dataclasses import dataclass

from protos.pagedserve.v1 import generation_pb2
from scheduler_service.core.request import Request
from scheduler_service.frontend.validation import InvalidArgument, RequestLimits


@dataclass(slots=True, frozen=True)
class ResumePoint:
    """Per sequence index: the tokens the client has; the indexes it has whole."""

    tokens: dict[int, list[int]]
    finished: frozenset[int]


def resume_point(request: generation_pb2.GenerateRequest, n: int, max_tokens: int, limits: RequestLimits
                 ) -> ResumePoint | None:
    """The request's resume point, checked (InvalidArgument naming the field); None when it has none."""
    if not request.resume:
        return None
    if not request.request_id:
        raise InvalidArgument("request_id", "a resumed call needs the request_id of the call it continues")
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    for i, seq in enumerate(request.resume):
        where = f"resume[{i}]"
        if seq.index >= n:
            raise InvalidArgument(f"{where}.index", f"{seq.index} is not below n ({n})")
        if seq.index in tokens or seq.index in finished:
            raise InvalidArgument(f"{where}.index", f"sequence {seq.index} is listed twice")
        if seq.finished:
            finished.add(seq.index)
            continue
        if len(seq.token_ids) >= max_tokens:
            raise InvalidArgument(f"{where}.token_ids", f"{len(seq.token_ids)} tokens: an unfinished sequence has "
                                  f"fewer than max_tokens ({max_tokens})")
        if any(t >= limits.vocab_size for t in seq.token_ids):
            raise InvalidArgument(f"{where}.token_ids", f"a token id is not below the vocabulary size "
                                  f"({limits.vocab_size})")
        tokens[seq.index] = list(seq.token_ids)
    if len(finished) == n:
        raise InvalidArgument("resume", "every sequence is finished: nothing to resume")
    return ResumePoint(tokens, frozenset(finished))


def resumed_requests(requests: list[Request], point: ResumePoint | None) -> dict[int, Request]:
    """The requests to run by sequence index: the finished ones left out, the others given their tokens."""
    if point is None:
        return dict(enumerate(requests))
    out: dict[int, Request] = {}
    for index, request in enumerate(requests):
        if index in point.finished:
            continue
        tokens = point.tokens.get(index, [])
        request.output_token_ids = list(tokens)
        request.num_uncomputed_tokens = request.num_tokens
        out[index] = request
    return out
