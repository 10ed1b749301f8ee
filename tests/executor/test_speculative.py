"""Draft verification in the executor: the torch backend's one-pass verification gives the tokens of decoding
without drafts (greedy, and seeded sampling), the rejection rule keeps the target distribution (a statistical
test on a small vocabulary), and the shell checks and answers drafts (simulated backend)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import make_model
from executor_service.runner.sampler import Sampler, SampleRequest
from executor_service.runner.speculative import DraftContext, accept_runs, expand_drafts
from executor_service.runner.torch_backend import TorchBackend
from executor_service.server import ExecutorServicer
from executor_service.simulated import SimulatedBackend
from protos.pagedserve.v1 import executor_pb2

VOCAB = 64
GREEDY = SamplingConfig(temperature=0.0)
SEEDED = SamplingConfig(temperature=0.9, seed=7)
PENALISED = SamplingConfig(temperature=0.0, repetition_penalty=2.0, presence_penalty=2.0)
Drafter = Callable[[list[int], int], list[int]]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> TorchBackend:
    model = make_model(tmp_path_factory.mktemp("m") / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       vocab_size=VOCAB, init_std=0.2)
    return TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", block_size=4, num_gpu_blocks=64))


def decode(backend: TorchBackend, prompts: Sequence[list[int]], n: int, sampling: SamplingConfig,
           drafter: Drafter | None = None) -> list[list[int]]:
    """n tokens of each prompt, all of them stepped together as the server steps them (drafts from `drafter`,
    given a request's tokens and its index)."""
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    while any(len(t) - len(p) < n for t, p in zip(tokens, prompts, strict=True)):
        items = []
        for i, t in enumerate(tokens):
            drafts = drafter(t, i) if drafter is not None and computed[i] else []
            items.append(BatchItem(str(i), t, len(prompts[i]), computed[i], len(t) - computed[i], tables[i], True,
                                   sampling, drafts))
        for i, sample in enumerate(backend.execute(items)):
            assert sample is not None
            run = sample.run()
            assert 1 <= len(run) <= len(items[i].draft_token_ids) + 1
            computed[i] = len(tokens[i]) + len(run) - 1
            tokens[i] += [s.token_id for s in run]
    return [t[len(p):len(p) + n] for t, p in zip(tokens, prompts, strict=True)]


PROMPTS = [[3, 9, 4, 9, 4, 9, 4, 1], [5, 6, 7, 8, 5, 6, 7], [11, 12]]


def oracle(plain: list[list[int]], corrupt: float, seed: int) -> Drafter:
    """Drafts from the known answer, some of them (corrupt) replaced by wrong tokens, 0 to 4 of them."""
    rng = random.Random(seed)

    def drafter(tokens: list[int], i: int) -> list[int]:
        done = len(tokens) - len(PROMPTS[i])
        drafts = plain[i][done:done + rng.randrange(5)]
        return [(t + 1) % VOCAB if rng.random() < corrupt else t for t in drafts]
    return drafter


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, PENALISED], ids=["greedy", "seeded", "penalised"])
@pytest.mark.parametrize("corrupt", [0.0, 0.3, 1.0])
def test_verified_decoding_gives_the_tokens_of_plain_decoding(backend: TorchBackend, sampling: SamplingConfig,
                                                             corrupt: float) -> None:
    plain = decode(backend, PROMPTS, 16, sampling)
    assert decode(backend, PROMPTS, 16, sampling, oracle(plain, corrupt, seed=int(corrupt * 10))) == plain


def test_drafts_right_from_the_start_take_fewer_steps(backend: TorchBackend) -> None:
    plain = decode(backend, PROMPTS[:1], 12, GREEDY)
    calls = [0]
    execute = backend.execute

    def counted(items: list[BatchItem]) -> list[object]:
        calls[0] += 1
        return execute(items)  # type: ignore[return-value]
    backend.execute = counted  # type: ignore[method-assign,assignment]
    try:
        assert decode(backend, PROMPTS[:1], 12, GREEDY, oracle(plain, 0.0, seed=3)) == plain
    finally:
        del backend.execute
    assert calls[0] < 12


def test_a_draft_context_reads_as_the_list_it_stands_for() -> None:
    known, drafts = [4, 5, 6], (7, 8, 9)
    for used in range(4):
        context, expected = DraftContext(known, drafts, used), [*known, *drafts[:used]]
        assert len(context) == len(expected) and list(context) == expected
        assert [context[i] for i in range(-len(expected), len(expected))] == expected + expected
        assert context[1:-1] == expected[1:-1]
        with pytest.raises(IndexError):
            context[len(expected)]


# ---- the rejection rule keeps the target distribution ------------------------------------------------------

def test_verification_samples_the_target_distribution() -> None:
    """A draft d is accepted with probability p(d); the first token out follows p either way. 6,000 seeded trials
    on a 6-token vocabulary: a chi-square test of the first token (5 degrees of freedom, p < 0.001 fails) and
    the acceptance rate within 4.5 standard deviations of p(d). A verifier that accepts d more or less often than
    p(d) fails the second; one whose token at the draft's position is not drawn from p (a replacement drawn from
    p without removing d, say) fails the first."""
    probs = torch.tensor([0.05, 0.30, 0.15, 0.25, 0.10, 0.15])
    logits = probs.log()
    draft, trials = 1, 6000
    sampler = Sampler(0, torch.device("cpu"))
    requests = []
    for seed in range(trials):
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        requests += [SampleRequest(sampling, [0, 2], 1, 2), SampleRequest(sampling, [0, 2, draft], 1, 3)]
    samples = sampler.sample(logits.repeat(2 * trials, 1), requests)
    items = [BatchItem(str(i), [0, 2], 1, 1, 1, [0], True, SamplingConfig(), [draft]) for i in range(trials)]
    runs = [s.run() for s in accept_runs(items, range(trials), samples) if s is not None]
    counts = [0] * len(probs)
    for run in runs:
        counts[run[0].token_id] += 1
    chi2 = sum((c - trials * p) ** 2 / (trials * p) for c, p in zip(counts, probs.tolist(), strict=True))
    assert chi2 < 20.52, (chi2, counts)  # the 0.999 quantile of chi-square with 5 degrees of freedom
    accepted = sum(len(run) == 2 for run in runs)
    p = probs[draft].item()
    assert abs(accepted - trials * p) < 4.5 * math.sqrt(trials * p * (1 - p)), accepted
    assert all(len(run) == 1 or run[0].token_id == draft for run in runs)


# ---- the shell: checks and answers (simulated backend) -----------------------------------------------------

def servicer() -> ExecutorServicer:
    return ExecutorServicer(SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=0,
                                                            block_size=4, max_model_len=64)))


async def started(s: ExecutorServicer) -> int:
    """Request "a" with a 4-token prompt computed and its first token sampled; that token."""
    new = executor_pb2.NewRequest(request_id="a", token_ids=[65] * 4, num_prompt_tokens=4, num_scheduled_tokens=4,
                                  block_ids=[0, 1])
    result = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new]))
    return result.sampled.token_ids[0]


def drafted(drafts: list[int], blocks: int = 0, num_tokens: int = 1) -> executor_pb2.RunningRequests:
    return executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[num_tokens], num_new_blocks=[blocks],
                                        new_block_ids=list(range(2, 2 + blocks)), num_draft_tokens=[len(drafts)],
                                        draft_token_ids=drafts)


async def test_the_shell_answers_the_accepted_run_and_advances_the_request() -> None:
    s = servicer()
    await started(s)
    state = s.table.states["a"]
    backend = s.backend
    assert isinstance(backend, SimulatedBackend)
    probe = s.table.item(state, 1)
    truth = [backend.token_at(probe, 5 + j) for j in range(3)]
    result = await s.run_step(executor_pb2.StepRequest(step_id=2, running=drafted([truth[0], truth[1] ^ 1, 3])))
    assert not result.error and not result.errors
    assert list(result.sampled.num_tokens) == [2] and list(result.sampled.token_ids) == truth[:2]
    assert state.num_computed == 6 and state.token_ids[5:] == truth[:2]
    described = await s.Describe(executor_pb2.DescribeRequest(), None)
    assert described.capabilities.max_num_draft_tokens == 16


@pytest.mark.parametrize(("running", "num_steps", "message"), [
    (drafted([1] * 17, blocks=3), 1, "more than max_num_draft_tokens"),
    (drafted([1, 2, 3, 4]), 1, "need 3 blocks"),
    (drafted([1, 99999]), 1, "outside the vocabulary"),
    (drafted([1], num_tokens=0), 1, "last token"),
])
async def test_bad_drafts_fail_their_request(running: executor_pb2.RunningRequests, num_steps: int,
                                             message: str) -> None:
    s = servicer()
    await started(s)
    result = await s.run_step(executor_pb2.StepRequest(step_id=2, running=running, num_steps=num_steps))
    assert not result.error and message in result.errors[0].message


async def test_model_drafts_for_an_executor_without_a_draft_model_fail_their_request() -> None:
    """#31: the simulated executor has no draft model: it advertises max_num_model_draft_tokens 0 and refuses a
    request that asks for draft-model tokens (a malformed column refuses the step)."""
    s = servicer()
    await started(s)
    described = await s.Describe(executor_pb2.DescribeRequest(), None)
    assert described.capabilities.max_num_model_draft_tokens == 0
    asked = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[1], num_new_blocks=[0],
                                         num_model_draft_tokens=[2])
    result = await s.run_step(executor_pb2.StepRequest(step_id=2, running=asked))
    assert not result.error and "exceeds max_num_model_draft_tokens 0" in result.errors[0].message
    asked.num_model_draft_tokens[:] = [2, 2]
    assert "num_model_draft_tokens" in (await s.run_step(executor_pb2.StepRequest(step_id=3, running=asked))).error


async def test_malformed_draft_columns_or_multi_step_refuse_the_step() -> None:
    s = servicer()
    await started(s)
    bad = drafted([1, 2])
    bad.num_draft_tokens[:] = [3]
    assert "num_draft_tokens" in (await s.run_step(executor_pb2.StepRequest(step_id=2, running=bad))).error
    multi = executor_pb2.StepRequest(step_id=3, running=drafted([1]), num_steps=2)
    assert "num_steps 1" in (await s.run_step(multi)).error


@pytest.fixture(scope="module")
def drafting(tmp_path_factory: pytest.TempPathFactory) -> TorchBackend:
    """A backend whose --draft-model is the model itself: every greedy draft must be accepted."""
    model = make_model(tmp_path_factory.mktemp("d") / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       vocab_size=VOCAB, init_std=0.2)
    return TorchBackend.create(ExecutorConfig(model=str(model), draft_model=str(model), device="cpu", block_size=4,
                                              num_gpu_blocks=64, num_cpu_blocks=32))


class ModelDrafting:
    """Requests stepped as the server steps them with k draft-model tokens each (after the prefill), keeping
    the draft model's computed count as server.py does; records every run's length."""

    def __init__(self, backend: TorchBackend, prompts: Sequence[list[int]], k: int) -> None:
        self.backend, self.prompts, self.k = backend, [list(p) for p in prompts], k
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.draft_computed = [0] * len(prompts)
        self.tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
        self.runs: list[int] = []

    def step(self) -> None:
        items = [BatchItem(str(i), t, len(self.prompts[i]), self.computed[i], len(t) - self.computed[i],
                           self.tables[i], True, GREEDY, num_model_drafts=self.k if self.computed[i] else 0,
                           draft_start=min(self.draft_computed[i], self.computed[i]))
                 for i, t in enumerate(self.tokens)]
        for i, sample in enumerate(self.backend.execute(items)):
            assert sample is not None
            run = sample.run()
            item = items[i]
            self.computed[i] = item.start + item.num_tokens + len(run) - 1
            if item.num_model_drafts:
                self.runs.append(len(run))
                fed = item.start + item.num_tokens + item.num_model_drafts - 1
                self.draft_computed[i] = min(self.computed[i], fed)
            self.tokens[i] += [s.token_id for s in run]

    def outputs(self, n: int) -> list[list[int]]:
        return [t[len(p):len(p) + n] for t, p in zip(self.tokens, self.prompts, strict=True)]


def test_the_model_as_its_own_draft_gives_plain_tokens_with_every_draft_accepted(drafting: TorchBackend) -> None:
    assert drafting.info.max_num_model_draft_tokens > 0 and drafting.draft is not None
    plain = decode(drafting, PROMPTS, 20, GREEDY)
    run = ModelDrafting(drafting, PROMPTS, 3)
    while min(len(t) - len(p) for t, p in zip(run.tokens, PROMPTS, strict=True)) < 20:
        run.step()
    assert run.outputs(20) == plain
    assert run.runs and all(n == 4 for n in run.runs), run.runs  # k drafts accepted and the model's own token


def test_the_draft_kv_follows_a_swap(drafting: TorchBackend) -> None:
    """Swapped out, the blocks overwritten by another request, swapped back in elsewhere: the draft model's KV
    came along, so its drafts are still the model's tokens (without the draft KV's swap they are not)."""
    plain = decode(drafting, PROMPTS[:1], 24, GREEDY)
    run = ModelDrafting(drafting, PROMPTS[:1], 3)
    for _ in range(3):
        run.step()
    used = run.tables[0][:-(-run.computed[0] // 4)]
    drafting.swap_out([(b, s) for s, b in enumerate(used)])
    decode(drafting, [[13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]], 4, GREEDY)  # blocks 0-15
    moved = list(range(40, 40 + len(used)))
    drafting.swap_in([(s, b) for s, b in enumerate(moved)])
    run.tables[0] = moved + list(range(40 + len(used), 56))
    accepted_before = len(run.runs)
    while len(run.tokens[0]) - len(PROMPTS[0]) < 24:
        run.step()
    assert run.outputs(24) == plain
    assert all(n == 4 for n in run.runs[accepted_before:]), run.runs


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    target = make_model(tmp_path / "t", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=VOCAB)
    draft = make_model(tmp_path / "d", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=VOCAB * 2)
    with pytest.raises(ValueError, match=f"--draft-model {draft}: vocab_size {2 * VOCAB} differs"):
        TorchBackend.create(ExecutorConfig(model=str(target), draft_model=str(draft), device="cpu", block_size=4,
                                           num_gpu_blocks=16))


def test_expand_drafts_copies_every_field_and_leaves_the_item_alone() -> None:
    drafted = BatchItem("a", [5, 6, 7], 2, 2, 1, [3, 4], True, SamplingConfig(temperature=0.5, seed=9), (8, 9),
                        num_model_drafts=0, draft_start=1, window_tables=([1, 2],))
    plain = BatchItem("b", [5], 1, 0, 1, [0], True, SamplingConfig())
    expanded, same = expand_drafts([drafted, plain])
    assert expanded == replace(drafted, token_ids=[5, 6, 7, 8, 9], num_tokens=3, draft_token_ids=())
    assert same is plain
    assert drafted.token_ids == [5, 6, 7] and drafted.draft_token_ids == (8, 9) and drafted.num_tokens == 1
