"""Copy samples for training a model that copies: a passage, a blank line, then the passage again.

The quote/edit workload of speculative decoding (benchmarks/speculative.py's copy set) asks for an answer that
repeats spans of the prompt. The default model never saw such text, so it does not copy; a model fine-tuned on
these samples (training.py, TrainConfig.copy_fraction) does. A share of the repeats are edited -- a few words
swapped for other words of the same passage -- so the model learns to resume copying after a change rather than
to reproduce only verbatim text. Everything is drawn from a seeded random.Random: the same seed gives the same
samples.
"""

from __future__ import annotations

import random

SEPARATOR = "\n\n"
EDIT_EVERY = 12  # an edited repeat swaps about one word in this many


def edit_passage(passage: str, rng: random.Random) -> str:
    """The passage with about one word in EDIT_EVERY replaced by another word of the same passage."""
    words = passage.split(" ")
    for i in range(len(words)):
        if rng.randrange(EDIT_EVERY) == 0:
            words[i] = rng.choice(words)
    return " ".join(words)


def copy_documents(docs: list[str], edit_share: float, seed: int) -> list[str]:
    """Per passage one document: the passage, SEPARATOR, the passage again (edited with probability edit_share)."""
    rng = random.Random(seed)
    out = []
    for passage in docs:
        repeat = edit_passage(passage, rng) if rng.random() < edit_share else passage
        out.append(passage + SEPARATOR + repeat)
    return out
