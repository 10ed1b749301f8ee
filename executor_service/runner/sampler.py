"""Batched sampling with vLLM's parameter semantics.

Order per row: penalties (repetition over prompt + output, presence/frequency over output), logit_bias, the
structured-output token mask (forbidden tokens at -inf), the min_tokens mask (EOS and the request's stop_token_ids at
-inf until min_tokens tokens are out, as vLLM's MinTokensLogitsProcessor; where it would leave a constrained row no
token, the grammar wins),
then greedy argmax when temperature < 1e-5, else temperature, top-k, top-p, min-p and an exponential-race
draw (argmax of probs / Exp(1) noise, equivalent to sampling from probs). A seeded row's noise comes
from a generator seeded with mix(seed, position of the sampled token), so its tokens do not depend on
batching, preemption or recompute. Unseeded rows share one generator seeded once from the executor seed.

Logprobs are the raw model distribution: log_softmax of the logits before penalties, the min_tokens mask,
temperature and filtering (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from executor_service.backend import SampleOutput, SamplingConfig
from executor_service.seeding import MASK64, splitmix64

GREEDY_EPS = 1e-5
NUMPY_ARGMAX_MIN_ROWS = 4


@dataclass(slots=True)
class SampleRequest:
    """One row of logits to sample: its parameters, the tokens so far (prompt first), and the
    position of the token being sampled."""

    sampling: SamplingConfig
    token_ids: Sequence[int]
    num_prompt_tokens: int
    position: int
    token_mask: np.ndarray | None = None  # structured outputs: executor_service/token_masks.py's row


@dataclass(slots=True)
class RowSets:
    """Which rows of a batch need which work, found in one pass over the requests."""

    random: list[int]
    penalised: list[int]
    logprobs: list[int]
    masked: list[tuple[int, tuple[int, ...]]]  # (row, the ids it may not sample): below its min_tokens
    biased: list[int] = field(default_factory=list)  # rows with a logit_bias
    constrained: list[int] = field(default_factory=list)  # rows with a token mask

    @property
    def any(self) -> bool:
        return bool(self.random or self.penalised or self.logprobs or self.masked or self.biased or self.constrained)

    @classmethod
    def of(cls, requests: Sequence[SampleRequest], eos_token_ids: Sequence[int] = ()) -> RowSets:
        sets = cls([], [], [], [])
        for i, r in enumerate(requests):
            s = r.sampling
            if not is_greedy(s):
                sets.random.append(i)
            if has_penalty(s):
                sets.penalised.append(i)
            if s.logprobs is not None:
                sets.logprobs.append(i)
            if s.min_tokens:
                ids = s.masked_ids(r.position - r.num_prompt_tokens, eos_token_ids)
                if ids:
                    sets.masked.append((i, ids))
            if s.logit_bias:
                sets.biased.append(i)
            if r.token_mask is not None:
                sets.constrained.append(i)
        return sets


class Sampler:
    def __init__(self, seed: int, device: torch.device, eos_token_ids: Sequence[int] = ()) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)  # the model's EOS ids, masked with stop_token_ids below min_tokens
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed & (MASK64 >> 1))

    def sample(self, logits: Tensor, requests: Sequence[SampleRequest]) -> list[SampleOutput]:
        """Greedy rows cost one argmax over the batch; only the rows that need penalties, filtering, noise or
        logprobs pay for them, each step batched over those rows."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
        if not requests:
            return []
        rows = RowSets.of(requests, self.eos_token_ids)
        if not rows.any:
            return [SampleOutput(token_id=t) for t in argmax_rows(logits.float()).tolist()]
        logits = logits.float()
        raw_logprobs = None
        if rows.logprobs:
            raw_logprobs = torch.log_softmax(logits.index_select(0, self.index(rows.logprobs)), dim=-1)
        logits = apply_penalties(logits, requests, rows.penalised)
        logits = apply_logit_bias(logits, requests, rows.biased)
        logits = apply_token_masks(logits, requests, rows.constrained)
        unmasked, logits = logits, apply_min_tokens(logits, rows.masked)
        if rows.constrained and rows.masked:
            logits = keep_some_token(logits, unmasked, [row for row, _ in rows.masked])
        tokens = self.choose_tokens(logits, requests, rows.random)
        return build_outputs(tokens, raw_logprobs, requests, rows.logprobs)

    def greedy(self, logits: Tensor) -> list[SampleOutput]:
        """Every row plain greedy (plain_greedy): its argmax, as sample() answers such rows without building the
        requests it reads (#29: ~2 us a row of the step's serial time)."""
        return [SampleOutput(token_id=t) for t in argmax_rows(logits.float()).tolist()]

    def index(self, rows: list[int]) -> Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def choose_tokens(self, logits: Tensor, requests: Sequence[SampleRequest], random_rows: list[int]) -> Tensor:
        tokens = argmax_rows(logits)
        if not random_rows:
            return tokens
        rows = self.index(random_rows)
        configs = [requests[i].sampling for i in random_rows]
        probs = filtered_probs(logits.index_select(0, rows), configs)
        noise = self.exponential_noise(probs.shape, [requests[i] for i in random_rows])
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def exponential_noise(self, shape: torch.Size, requests: Sequence[SampleRequest]) -> Tensor:
        noise = torch.empty(shape, device=self.device)
        unseeded = [i for i, r in enumerate(requests) if r.sampling.seed is None]
        if len(unseeded) == len(requests):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            idx = torch.tensor(unseeded, device=self.device)
            noise[idx] = torch.empty((len(unseeded), shape[1]), device=self.device).exponential_(
                generator=self.generator)
        for i, request in enumerate(requests):
            if request.sampling.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(mix_seed(request.sampling.seed, request.position))
                noise[i].exponential_(generator=generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def argmax_rows(logits: Tensor) -> Tensor:
    """logits.argmax(dim=-1): the first index of each row's maximum, a NaN counting as the maximum. On the CPU
    numpy's argmax gives the same indices ~20x faster than torch's reduction over 64 rows (from 4 rows up it
    is the faster of the two)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.shape[0] < NUMPY_ARGMAX_MIN_ROWS:
        return logits.argmax(dim=-1)
    return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))


def is_greedy(sampling: SamplingConfig) -> bool:
    return sampling.temperature < GREEDY_EPS


def plain_greedy(sampling: SamplingConfig) -> bool:
    """Greedy with nothing that moves the argmax or asks for more than the token: no penalties, logit_bias,
    min_tokens or logprobs (a row's token mask is the caller's to check)."""
    return (sampling.temperature < GREEDY_EPS and sampling.logprobs is None and not sampling.min_tokens
            and not sampling.logit_bias and not has_penalty(sampling))


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed that depends on (seed, position) only."""
    return splitmix64(seed, position) & (MASK64 >> 1)


def apply_penalties(logits: Tensor, requests: Sequence[SampleRequest], rows: list[int] | None = None) -> Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties of `rows` (default: every row
    that has one), all rows at once; logits is not modified."""
    if rows is None:
        rows = [i for i, r in enumerate(requests) if has_penalty(r.sampling)]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    picked = [requests[i] for i in rows]
    seen, counts = token_stats(picked, vocab, device)
    rep = column([r.sampling.repetition_penalty for r in picked], device)
    freq = column([r.sampling.frequency_penalty for r in picked], device)
    presence = column([r.sampling.presence_penalty for r in picked], device)
    values = logits.index_select(0, index)
    values = torch.where(seen, torch.where(values > 0, values / rep, values * rep), values)
    values = values - freq * counts - presence * (counts > 0).to(values.dtype)
    return logits.index_copy(0, index, values)


def apply_min_tokens(logits: Tensor, masked: list[tuple[int, tuple[int, ...]]]) -> Tensor:
    """-inf at each masked (row, token id) pair, ids outside the vocabulary ignored; logits is not modified."""
    if not masked:
        return logits
    vocab = logits.shape[1]
    pairs = [(row, t) for row, ids in masked for t in ids if 0 <= t < vocab]
    if not pairs:
        return logits
    index = torch.tensor(pairs, dtype=torch.long, device=logits.device).t()
    return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: Tensor, requests: Sequence[SampleRequest], rows: list[int]) -> Tensor:
    """Each row's logit_bias added to its tokens' logits (ids outside the vocabulary ignored); logits is not
    modified."""
    vocab = logits.shape[1]
    pairs = [(row, t, b) for row in rows for t, b in requests[row].sampling.logit_bias if 0 <= t < vocab]
    if not pairs:
        return logits
    index = torch.tensor([(r, t) for r, t, _ in pairs], dtype=torch.long, device=logits.device).t()
    bias = torch.tensor([b for _, _, b in pairs], dtype=logits.dtype, device=logits.device)
    return logits.index_put((index[0], index[1]), bias, accumulate=True)


def apply_token_masks(logits: Tensor, requests: Sequence[SampleRequest], rows: list[int]) -> Tensor:
    """-inf at every token a row's token mask forbids, in place (the logits are this step's own: their raw logprobs
    were taken before). On the CPU through NumPy's view of the tensor: one pass over the row, no copy of it."""
    if not rows:
        return logits
    vocab = logits.shape[1]
    masks = np.stack([requests[i].token_mask for i in rows])  # type: ignore[misc]
    allowed = np.unpackbits(masks, axis=1, count=vocab, bitorder="little").view(bool)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        view = logits.numpy()
        for j, row in enumerate(rows):
            np.copyto(view[row], -np.inf, where=~allowed[j])
        return logits
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    forbid = torch.from_numpy(~allowed).to(logits.device)
    logits[index] = logits.index_select(0, index).masked_fill(forbid, float("-inf"))
    return logits


def keep_some_token(masked: Tensor, unmasked: Tensor, rows: list[int]) -> Tensor:
    """Rows the min_tokens mask left with no finite logit take their logits from before it (a grammar that allows
    only EOS ends the output even below min_tokens)."""
    index = torch.tensor(rows, dtype=torch.long, device=masked.device)
    empty = torch.isinf(masked.index_select(0, index)).all(dim=-1)
    if not bool(empty.any()):
        return masked
    back = index[empty]
    return masked.index_copy(0, back, unmasked.index_select(0, back))


def token_stats(requests: Sequence[SampleRequest], vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(seen [n, vocab]: token anywhere in prompt or output, counts [n, vocab]: occurrences in the output).
    Ids outside the vocabulary are ignored."""
    width = max(1, max(len(r.token_ids) for r in requests))
    padded = torch.full((len(requests), width), vocab, dtype=torch.long)
    for i, r in enumerate(requests):
        padded[i, : len(r.token_ids)] = torch.tensor(list(r.token_ids), dtype=torch.long)
    padded = padded.masked_fill_((padded < 0) | (padded > vocab), vocab).to(device)
    is_output = torch.arange(width, device=device)[None, :] >= column(
        [r.num_prompt_tokens for r in requests], device, torch.long)
    seen = torch.zeros(len(requests), vocab + 1, dtype=torch.bool, device=device).scatter_(1, padded, True)
    output_ids = padded.masked_fill(~is_output, vocab)
    counts = torch.zeros(len(requests), vocab + 1, device=device).scatter_add_(
        1, output_ids, torch.ones(output_ids.shape, device=device))
    return seen[:, :vocab], counts[:, :vocab]


def column(values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


def has_penalty(s: SamplingConfig) -> bool:
    return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0


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


def build_outputs(tokens: Tensor, raw_logprobs: Tensor | None, requests: Sequence[SampleRequest],
                  rows: list[int]) -> list[SampleOutput]:
    """raw_logprobs holds the rows listed in `rows` (those that asked for logprobs), in that order."""
    token_list = tokens.tolist()
    outputs = [SampleOutput(token_id=int(t)) for t in token_list]
    if raw_logprobs is None:
        return outputs
    max_k = max(requests[i].sampling.logprobs or 0 for i in rows)
    picked = raw_logprobs.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
    top_values, top_ids = raw_logprobs.topk(min(max_k, raw_logprobs.shape[1]), dim=-1)
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = requests[i].sampling.logprobs or 0
        outputs[i].logprob = float(picked[j])
        outputs[i].top_logprobs = list(zip(top_ids_list[j][:k], top_values_list[j][:k], strict=True))
    return outputs
