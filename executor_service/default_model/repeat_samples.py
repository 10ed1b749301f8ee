"""Repeat rows for the copy warm-up: a random token segment, repeated until the row is full, loss on the repeats.

A small transformer learns to copy text it cannot otherwise predict -- random tokens, the segment seen once
already -- by growing induction heads ("after the token I saw before, comes what followed it then"), and it does
so fast on this pure task; on natural text its prior (the corpus's templates) answers first and the copy is
learned slowly if at all (BENCHMARKS.md section 15). A row is BOS, a segment of random tokens, the separator, the
segment again, the separator, ... cut at seq_len + 1 tokens; the targets over BOS and the first copy are
IGNORE (nothing there can be predicted), so the loss is the copy's alone. Everything is drawn from the given
torch.Generator: the same seed gives the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # cross_entropy's ignore_index: a target that does not count


@dataclass(slots=True, frozen=True)
class RepeatSpec:
    """What repeat rows are made of: the tokens a segment draws from (uniformly), the tokens between copies, and
    the range of segment lengths (inclusive)."""

    vocab: torch.Tensor
    separator: tuple[int, ...]
    bos: int
    min_len: int
    max_len: int


@dataclass(slots=True, frozen=True)
class Batch:
    """Model inputs and the targets the loss reads (IGNORE where it reads none)."""

    inputs: torch.Tensor
    targets: torch.Tensor


def repeat_row(spec: RepeatSpec, length: int, seq_len: int, generator: torch.Generator) -> Batch:
    """One row of seq_len inputs: BOS, a segment of `length` random tokens, then separator + segment over and
    over; targets are the next tokens, IGNORE up to the first copy's end."""
    segment = spec.vocab[torch.randint(0, len(spec.vocab), (length,), generator=generator)]
    unit = torch.cat([torch.tensor(spec.separator, dtype=torch.long), segment])
    copies = max(0, -(-(seq_len - length) // len(unit)))
    row = torch.cat([torch.tensor([spec.bos]), segment, unit.repeat(copies)])[: seq_len + 1]
    targets = row[1:].clone()
    targets[:length] = IGNORE
    return Batch(row[:-1], targets)


def repeat_batch(spec: RepeatSpec, rows: int, seq_len: int, generator: torch.Generator) -> Batch:
    """`rows` repeat rows, each with a segment length drawn from [min_len, min(max_len, seq_len // 2)]."""
    high = max(spec.min_len, min(spec.max_len, seq_len // 2))
    lengths = torch.randint(spec.min_len, high + 1, (rows,), generator=generator).tolist()
    made = [repeat_row(spec, length, seq_len, generator) for length in lengths]
    return Batch(torch.stack([b.inputs for b in made]), torch.stack([b.targets for b in made]))


def corpus_vocab(stream: torch.Tensor, special: tuple[int, ...]) -> torch.Tensor:
    """The distinct tokens of a token stream, specials left out, sorted: what a segment draws from."""
    found = torch.unique(stream)
    return found[~torch.isin(found, torch.tensor(special, dtype=torch.long))]
