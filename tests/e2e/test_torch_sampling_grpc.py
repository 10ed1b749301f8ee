"""Every sampling parameter reaches the torch executor through Generate: a real executor process
(--model DIR), a real scheduler process, a client over gRPC. Each test would fail if the scheduler
dropped its parameter on the way (the simulated executor ignores sampling, so only a model can tell)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from client.lib import PagedServeClient
from executor_service.default_model.model import TOKENIZER_VOCAB_SIZE, make_model
from tests.support.procs import Stack, running_stack

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 16
PROMPT = [random.Random(5).randrange(3, TOKENIZER_VOCAB_SIZE) for _ in range(12)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = make_model(tmp_path_factory.mktemp("sampling") / "llama", hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, vocab_size=TOKENIZER_VOCAB_SIZE, init_std=0.2, seed=11)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(scope="module")
def stack(model: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    executor = ["--model", str(model[0]), "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "256",
                "--num-cpu-blocks", "16"]
    with running_stack(tmp_path_factory.mktemp("sampling-stack"), executor) as s:
        yield s


def generate(stack: Stack, **sampling: Any) -> tuple[list[int], list[Any]]:
    async def go() -> tuple[list[int], list[Any]]:
        ids: list[int] = []
        logprobs: list[Any] = []
        async with PagedServeClient(stack.address) as client:
            async for r in client.generate(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                           timeout=120, **sampling):
                ids += r.token_ids
                logprobs += r.logprobs
        return ids, logprobs

    return asyncio.run(go())


@pytest.fixture(scope="module")
def greedy(stack: Stack, model: tuple[Path, Any]) -> list[int]:
    ids, _ = generate(stack, temperature=0.0)
    with torch.inference_mode():
        prompt = torch.tensor([PROMPT])
        reference = model[1].generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ids == reference[0, len(PROMPT):].tolist()
    assert len(set(ids)) < len(ids), "the penalty tests need a greedy output that repeats a token"
    return ids


@pytest.mark.parametrize("filter_args", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}],
                         ids=["top_k=1", "top_p=1e-6", "min_p=1"])
def test_a_filter_that_keeps_only_the_best_token_equals_greedy(stack: Stack, greedy: list[int],
                                                               filter_args: dict[str, float]) -> None:
    unfiltered, _ = generate(stack, temperature=1.5, seed=3)
    assert unfiltered != greedy, "seeded sampling at temperature 1.5 must differ from greedy for this test"
    filtered, _ = generate(stack, temperature=1.5, seed=3, **filter_args)
    assert filtered == greedy


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"frequency_penalty": 2.0}], ids=lambda p: next(iter(p)))
def test_a_strong_penalty_changes_the_greedy_output(stack: Stack, greedy: list[int], penalty: dict[str, float]) -> None:
    penalised, _ = generate(stack, temperature=0.0, **penalty)
    assert penalised != greedy
    assert len(set(penalised)) > len(set(greedy)), "a penalty on repeats should make the output more varied"


def test_logprobs_match_a_transformers_forward(stack: Stack, greedy: list[int], model: tuple[Path, Any]) -> None:
    ids, logprobs = generate(stack, temperature=0.0, logprobs=3)
    assert ids == greedy and [lp.token_id for lp in logprobs] == ids
    with torch.inference_mode():
        logits = model[1](torch.tensor([PROMPT + ids[:-1]])).logits[0, len(PROMPT) - 1:]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(expected[i, ids[i]].item(), abs=1e-3)
        top = [(t.token_id, t.logprob) for t in lp.top]
        assert len(top) == 3 and top[0][0] == ids[i]
        want = torch.topk(expected[i], 3)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-3)
