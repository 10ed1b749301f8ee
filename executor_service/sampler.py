"""Batched sampling with vLLM's parameter semantics.

Order per row: penalties (repetition over prompt + output, presence/frequency over output), then
greedy argmax when temperature < 1e-5, else temperature, top-k, top-p, min-p and an exponential-race
draw (argmax of probs / Exp(1) noise, equivalent to sampling from probs). A seeded row's noise comes
from a generator seeded with mix(seed, position of the sampled token), so its tokens do not depend on
batching, preemption or recompute. Unseeded rows share one generator seeded once from the executor seed.

Logprobs are the raw model distribution: log_softmax of the logits before penalties, temperature
and filtering (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from executor_service.backend import SampleOutput, SamplingConfig
from executor_service.seeding import MASK64, splitmix64

GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SampleRequest:
    """One row of logits to sample: its parameters, the tokens so far (prompt first), and the
    position of the token being sampled."""

    sampling: SamplingConfig
    token_ids: Sequence[int]
    num_prompt_tokens: int
    position: int


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed & (MASK64 >> 1))

    def sample(self, logits: Tensor, requests: Sequence[SampleRequest]) -> list[SampleOutput]:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
        if not requests:
            return []
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any_logprobs(requests) else None
        logits = apply_penalties(logits, requests)
        tokens = self.choose_tokens(logits, requests)
        return build_outputs(tokens, raw_logprobs, requests)

    def choose_tokens(self, logits: Tensor, requests: Sequence[SampleRequest]) -> Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not is_greedy(r.sampling)]
        if not random_rows:
            return tokens
        rows = torch.tensor(random_rows, device=logits.device)
        configs = [requests[i].sampling for i in random_rows]
        probs = filtered_probs(logits.index_select(0, rows), configs)
        noise = self.exponential_noise(probs.shape, [requests[i] for i in random_rows])
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def exponential_noise(self, shape: torch.Size, requests: Sequence[SampleRequest]) -> Tensor:
        noise = torch.empty(shape, device=self.device)
        unseeded = [i for i, r in enumerate(requests) if r.sampling.seed is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=self.device)
            noise[idx] = torch.empty((len(unseeded), shape[1]), device=self.device).exponential_(
                generator=self.generator)
        for i, request in enumerate(requests):
            if request.sampling.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(mix_seed(request.sampling.seed, request.position))
                noise[i].exponential_(generator=generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def is_greedy(sampling: SamplingConfig) -> bool:
    return sampling.temperature < GREEDY_EPS


def any_logprobs(requests: Sequence[SampleRequest]) -> bool:
    return any(r.sampling.logprobs is not None for r in requests)


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed that depends on (seed, position) only."""
    return splitmix64(seed, position) & (MASK64 >> 1)


def apply_penalties(logits: Tensor, requests: Sequence[SampleRequest]) -> Tensor:
    rows = [i for i, r in enumerate(requests) if has_penalty(r.sampling)]
    if not rows:
        return logits
    vocab = logits.shape[1]
    logits = logits.clone()
    for i in rows:
        logits[i] = penalise_row(logits[i], requests[i], vocab)
    return logits


def has_penalty(s: SamplingConfig) -> bool:
    return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0


def penalise_row(row: Tensor, request: SampleRequest, vocab: int) -> Tensor:
    s = request.sampling
    tokens = torch.tensor(list(request.token_ids), dtype=torch.long, device=row.device)
    output = valid_ids(tokens[request.num_prompt_tokens :], vocab)
    tokens = valid_ids(tokens, vocab)
    if s.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[tokens] = True
        penalised = torch.where(row > 0, row / s.repetition_penalty, row * s.repetition_penalty)
        row = torch.where(seen, penalised, row)
    if s.presence_penalty != 0.0 or s.frequency_penalty != 0.0:
        counts = torch.bincount(output, minlength=vocab).to(row.dtype)
        row = row - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).to(row.dtype)
    return row


def valid_ids(ids: Tensor, vocab: int) -> Tensor:
    return ids[(ids >= 0) & (ids < vocab)]


def filtered_probs(logits: Tensor, configs: Sequence[SamplingConfig]) -> Tensor:
    """Softmax after temperature, top-k, top-p and min-p; each row keeps at least its best token."""
    device = logits.device
    temperature = torch.tensor([c.temperature for c in configs], device=device)
    logits = logits / temperature[:, None]
    if any(c.top_k > 0 or c.top_p < 1.0 for c in configs):
        logits = apply_top_k_top_p(logits, configs)
    probs = torch.softmax(logits, dim=-1)
    if any(c.min_p > 0.0 for c in configs):
        min_p = torch.tensor([c.min_p for c in configs], device=device)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def apply_top_k_top_p(logits: Tensor, configs: Sequence[SamplingConfig]) -> Tensor:
    device = logits.device
    vocab = logits.shape[1]
    top_k = torch.tensor([c.top_k if 0 < c.top_k < vocab else vocab for c in configs], device=device)
    top_p = torch.tensor([c.top_p for c in configs], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1)[:, None])
    drop = sorted_logits < kth
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def build_outputs(tokens: Tensor, raw_logprobs: Tensor | None,
                  requests: Sequence[SampleRequest]) -> list[SampleOutput]:
    token_list = tokens.tolist()
    outputs = [SampleOutput(token_id=int(t)) for t in token_list]
    if raw_logprobs is None:
        return outputs
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    max_k = max(requests[i].sampling.logprobs or 0 for i in rows)
    picked = raw_logprobs[rows].gather(1, tokens[rows][:, None]).squeeze(1).tolist()
    top_values, top_ids = raw_logprobs[rows].topk(min(max_k, raw_logprobs.shape[1]), dim=-1)
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = requests[i].sampling.logprobs or 0
        outputs[i].logprob = float(picked[j])
        outputs[i].top_logprobs = list(zip(top_ids_list[j][:k], top_values_list[j][:k], strict=True))
    return outputs
