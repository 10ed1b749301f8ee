"""Copy samples for training a model that copies: a passage, a blank line, then the passage again.

The quote/edit workload of speculative decoding (benchmarks/speculative.py's copy set) asks for an answer that
repeats spans of the prompt. The default model never saw such text, so it does not copy; a model fine-tuned on
these samples (training.py, TrainConfig.copy_fraction) does. A share of the repeats are edited -- a few words
swapped for other words of the same passage -- so the model learns to resume copying after a change rather than
to reproduce only verbatim text. Another share is passages with their words shuffled: text the corpus's templates
cannot predict, so only copying lowers its loss (the templated corpus otherwise lets the model "copy" a passage's
frame while filling in other names and objects). Everything is drawn from a seeded random.Random: the same seed
gives the same samples.
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


def shuffle_passage(passage: str, rng: random.Random) -> str:
    words = passage.split(" ")
    rng.shuffle(words)
    return " ".join(words)


def copy_documents(docs: list[str], edit_share: float, seed: int, shuffle_share: float = 0.0) -> list[str]:
    """Per passage one document: the passage (its words shuffled with probability shuffle_share), SEPARATOR, the
    passage again (edited with probability edit_share)."""
    rng = random.Random(seed)
    out = []
    for text in docs:
        passage = shuffle_passage(text, rng) if shuffle_share and rng.random() < shuffle_share else text
        repeat = edit_passage(passage, rng) if rng.random() < edit_share else passage
        out.append(passage + SEPARATOR + repeat)
    return out
