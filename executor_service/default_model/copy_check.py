"""Does a model copy? The n-gram proposer's best case on quote prompts, in process (for training) or on outputs.

A quote prompt is a corpus paragraph, a blank line and its first third again (benchmarks/speculative.py's copy
set): a model that copies answers with the rest of the paragraph. `ngram_tokens_per_step` scores an answer by the
output tokens per step that n-gram speculation (the scheduler's proposer, k drafts, prompt_lookup 2-5) would
reach drafting at every step with a verification as cheap as a decode: 1.0 for no copy, k + 1 for a full one.
`quote_fidelity` scores how much of the passage's rest the answer reproduces (a model that loops on one token
has a high n-gram score and no fidelity). `probe_copying` runs both on a transformers model's greedy answers, so
training can watch copying grow. torch is
imported where a model runs, so the benchmarks' drivers import the prompts without it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_service.core.speculative import propose_ngram

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

SEPARATOR = "\n\n"


def quote_passages(text: str, count: int) -> list[str]:
    """The first `count` paragraphs of 300 - 900 characters that are not chat turns: the copy set's passages."""
    found = [p.strip() for p in text.split(SEPARATOR) if 300 <= len(p.strip()) <= 900 and "User:" not in p]
    return found[:count]


def quote_prompt(paragraph: str) -> str:
    """The paragraph, a blank line, its first third (by words) again."""
    words = paragraph.split(" ")
    return paragraph + SEPARATOR + " ".join(words[:len(words) // 3])


def ngram_tokens_per_step(prompt: list[int], output: list[int], k: int) -> float:
    """Output tokens per step with n-gram drafts at every step (the proposer of the scheduler)."""
    known, done, steps = list(prompt), 0, 0
    while done < len(output):
        drafts = propose_ngram(known, k, 2, 5)
        accepted = 0
        while accepted < len(drafts) and done + accepted < len(output) and drafts[accepted] == output[done + accepted]:
            accepted += 1
        take = min(accepted + 1, len(output) - done)
        known += output[done:done + take]
        done, steps = done + take, steps + 1
    return len(output) / steps if steps else 0.0


def greedy_answer(model: LlamaForCausalLM, prompt: list[int], output_len: int) -> list[int]:
    """The model's greedy continuation (EOS ignored), decoded with its KV cache."""
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def quote_fidelity(answer: list[int], expected: list[int]) -> float:
    """The share of the expected quote (cut to the answer's length) that the answer reproduces: tokens in
    matching blocks (difflib), so a slip of one token costs one token, not the rest of the quote. A model that
    loops on one token scores high n-gram tokens per step but near 0 here."""
    n = min(len(answer), len(expected))
    if n == 0:
        return 0.0
    blocks = difflib.SequenceMatcher(None, answer[:n], expected[:n], autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks) / n


@dataclass(slots=True, frozen=True)
class CopyScore:
    """A probe's means over its prompts: n-gram best case (tokens per step) and quote fidelity (0 - 1)."""

    tokens_per_step: float
    fidelity: float


def probe_copying(model: LlamaForCausalLM, tokenizer: Tokenizer, text: str, bos: int, prompts: int = 8,
                  output_len: int = 96, k: int = 4) -> CopyScore:
    """The model's greedy answers to the first quote prompts (BOS first, as the server's tokenizer sends them),
    scored; the model is put in eval mode for it and back in train mode after."""
    import torch

    steps, fidelity = [], []
    model.eval()
    try:
        with torch.inference_mode():
            for passage in quote_passages(text, prompts):
                prompt = quote_prompt(passage)
                ids = [bos, *tokenizer.encode(prompt, add_special_tokens=False).ids]
                rest = passage.split(" ")[len(passage.split(" ")) // 3:]
                whole = [bos, *tokenizer.encode(prompt + " " + " ".join(rest), add_special_tokens=False).ids]
                answer = greedy_answer(model, ids, output_len)
                steps.append(ngram_tokens_per_step(ids, answer, k))
                fidelity.append(quote_fidelity(answer, whole[len(ids):]))
    finally:
        model.train()
    return CopyScore(sum(steps) / len(steps), sum(fidelity) / len(fidelity))
