"""OpenAI response objects built from GenerateResponses: choices, logprobs, usage, stream chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos.pagedserve.v1 import common_pb2, generation_pb2
from scheduler_service.frontend.openai.errors import ApiError
from scheduler_service.frontend.tokenizer import TextTokenizer

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


def stop_reason(response: generation_pb2.GenerateResponse) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the sequence; None otherwise (also for EOS)."""
    which = response.WhichOneof("stop_reason")
    return None if which is None else getattr(response, which)


def finish_reason(response: generation_pb2.GenerateResponse) -> str | None:
    """The OpenAI finish reason; a failed sequence raises its error as a 500."""
    if response.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    if response.finish_reason == generation_pb2.FINISH_REASON_ERROR:
        raise ApiError(500, f"generation failed: {response.error or 'executor error'}")
    return FINISH_REASONS[response.finish_reason]


@dataclass(slots=True)
class Usage:
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, prompt_index: int, response: generation_pb2.GenerateResponse) -> None:
        if response.finish_reason:
            self.prompt_tokens[prompt_index] = response.usage.prompt_tokens
            self.completion_tokens += response.usage.completion_tokens

    def body(self) -> dict[str, int]:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}


@dataclass(slots=True)
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True, frozen=True)
class PromptLogprobs:
    """A prompt's token ids and the logprob entries of its positions 1 .. (GenerateResponse.prompt_logprobs)."""

    token_ids: list[int]
    entries: list[common_pb2.TokenLogprobs]

    @classmethod
    def of(cls, response: generation_pb2.GenerateResponse) -> PromptLogprobs:
        return cls(list(response.prompt_token_ids), list(response.prompt_logprobs))


class LogprobFormatter:
    """Token strings for logprobs, in the completions and the chat shapes."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text

    def completion(self, logprobs: list[common_pb2.TokenLogprobs], offset: int) -> dict[str, Any]:
        tokens = [self.token(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [self._top(lp) for lp in logprobs], "text_offset": offsets}

    def _top(self, lp: common_pb2.TokenLogprobs, limit: int | None = None) -> dict[str, float]:
        """The top alternatives (the first `limit` of them) and, as OpenAI and vLLM always give it, the sampled
        token (so logprobs: k has up to k + 1 entries, and 0 has the sampled one)."""
        top = {self.token(t.token_id): t.logprob for t in lp.top[:limit]}
        top.setdefault(self.token(lp.token_id), lp.logprob)
        return top

    def echoed(self, prompt: PromptLogprobs, k: int, completion: dict[str, Any]) -> dict[str, Any]:
        """Completion logprobs (completion()'s shape) led by the prompt's, as OpenAI's legacy echo gives them: the
        prompt's tokens first, the first with logprob and top_logprobs null, text offsets running on through the
        completion's."""
        tokens = [self.token(t) for t in prompt.token_ids]
        offsets = []
        offset = 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens + completion["tokens"],
                "token_logprobs": [None, *(e.logprob for e in prompt.entries), *completion["token_logprobs"]],
                "top_logprobs": [None, *(self._top(e, k) for e in prompt.entries), *completion["top_logprobs"]],
                "text_offset": offsets + [offset + o for o in completion["text_offset"]]}

    def prompt_logprobs(self, prompt: PromptLogprobs, k: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs of a choice: None for the first token, then per position the prompt token and the
        top k alternatives by token id, each with its logprob, rank (1 = most likely; null where the token is not
        among the alternatives the executor gave) and decoded text."""
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for e in prompt.entries:
            ranks = {t.token_id: r for r, t in enumerate(e.top, 1)}
            entry = {str(t.token_id): self._vllm_entry(t.token_id, t.logprob, ranks) for t in e.top[:k]}
            entry.setdefault(str(e.token_id), self._vllm_entry(e.token_id, e.logprob, ranks))
            out.append(entry)
        return out

    def _vllm_entry(self, token_id: int, logprob: float, ranks: dict[int, int]) -> dict[str, Any]:
        return {"logprob": logprob, "rank": ranks.get(token_id), "decoded_token": self.token(token_id)}

    def chat(self, logprobs: list[common_pb2.TokenLogprobs]) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t.token_id, t.logprob) for t in lp.top]}
                            for lp in logprobs]}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def completion_choice(choice: Choice, formatter: LogprobFormatter | None) -> dict[str, Any]:
    logprobs = formatter.completion(choice.logprobs, 0) if formatter is not None else None
    return {"index": choice.index, "text": "".join(choice.text), "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


def chat_choice(choice: Choice, formatter: LogprobFormatter | None) -> dict[str, Any]:
    logprobs = formatter.chat(choice.logprobs) if formatter is not None else None
    return {"index": choice.index, "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": logprobs, "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
