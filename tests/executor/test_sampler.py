"""Sampler: greedy, filters, penalties, seeded determinism by (seed, position), logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from executor_service.backend import SamplingConfig
from executor_service.runner.sampler import (
    Sampler,
    SampleRequest,
    apply_penalties,
    argmax_rows,
    filtered_probs,
    mix_seed,
)

CPU = torch.device("cpu")
VOCAB = 64


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def request(sampling: SamplingConfig, position: int = 10, prompt: tuple[int, ...] = (),
            output: tuple[int, ...] = ()) -> SampleRequest:
    return SampleRequest(sampling, (*prompt, *output), len(prompt), position)


def test_greedy_is_argmax_and_does_not_mutate_logits() -> None:
    logits = random_logits(6)
    before = logits.clone()
    configs = [SamplingConfig(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)] * 6
    out = Sampler(0, CPU).sample(logits, [request(c) for c in configs])
    assert [o.token_id for o in out] == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)
    assert all(o.logprob is None and o.top_logprobs == [] for o in out)


@pytest.mark.parametrize("vocab", [1, 5, 64, 2048])
def test_fast_argmax_keeps_torch_argmax_ties_and_nans(vocab: int) -> None:
    logits = torch.randint(0, 3, (12, vocab), generator=torch.Generator().manual_seed(vocab)).float()
    logits[1] = float("nan")
    logits[2, vocab // 2:] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = float("inf")
    logits[5] = 1.0
    for view in (logits, logits.t().contiguous().t(), logits[::2], logits[4:6], logits.half()):
        with torch.inference_mode():
            fast = argmax_rows(view)
        assert fast.dtype == torch.long and torch.equal(fast, view.argmax(dim=-1))


def test_greedy_rows_beside_random_rows_are_argmax() -> None:
    logits = torch.randint(0, 2, (16, VOCAB), generator=torch.Generator().manual_seed(3)).float()
    configs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0),
               SamplingConfig(temperature=0.7, seed=1)] * 4
    out = Sampler(0, CPU).sample(logits, [request(c) for c in configs])
    greedy = [i for i, c in enumerate(configs) if c.temperature == 0.0]
    assert [out[i].token_id for i in greedy] == logits.argmax(dim=-1)[greedy].tolist()


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(8, seed=1)
    configs = [SamplingConfig(temperature=1.5, top_k=1), SamplingConfig(temperature=0.8, top_k=1, seed=5)] * 4
    out = Sampler(3, CPU).sample(logits, [request(c, position=i) for i, c in enumerate(configs)])
    assert [o.token_id for o in out] == logits.argmax(dim=-1).tolist()


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 9] = 2.0, 1.9
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.2)
    out = Sampler(0, CPU).sample(logits, [request(sampling, prompt=(7,))])
    assert out[0].token_id == 9


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    logits = random_logits(1, seed=2)[0] * 0.3
    sampling = SamplingConfig(temperature=1.0, seed=42)

    def draw(sampler_seed: int, position: int, companions: int) -> int:
        rows = torch.stack([random_logits(1, seed=100 + i)[0] for i in range(companions)] + [logits])
        reqs = [request(SamplingConfig(temperature=1.0)) for _ in range(companions)]
        return Sampler(sampler_seed, CPU).sample(rows, [*reqs, request(sampling, position)])[-1].token_id

    tokens = [draw(0, p, 0) for p in range(40)]
    assert tokens == [draw(7, p, p % 3) for p in range(40)]
    assert len(set(tokens)) > 5
    other_seed = [Sampler(0, CPU).sample(logits[None], [request(SamplingConfig(seed=43), p)])[0].token_id
                  for p in range(40)]
    assert other_seed != tokens


def test_mix_seed_separates_seed_and_position() -> None:
    values = {mix_seed(s, p) for s in range(20) for p in range(20)}
    assert len(values) == 400
    assert all(0 <= v < 2**63 for v in values)


def test_unseeded_rows_follow_the_executor_seed() -> None:
    logits = random_logits(16, seed=3) * 0.2
    reqs = [request(SamplingConfig(temperature=1.0)) for _ in range(16)]
    first = [o.token_id for o in Sampler(11, CPU).sample(logits, reqs)]
    again = [o.token_id for o in Sampler(11, CPU).sample(logits, reqs)]
    other = [o.token_id for o in Sampler(12, CPU).sample(logits, reqs)]
    assert first == again and first != other


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).expand(4000, 4).contiguous()
    reqs = [request(SamplingConfig(temperature=1.0)) for _ in range(4000)]
    tokens = torch.tensor([o.token_id for o in Sampler(0, CPU).sample(logits, reqs)])
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq.tolist() == pytest.approx([0.5, 0.3, 0.2, 0.0], abs=0.04)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    configs = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.25)]
    probs = filtered_probs(logits.expand(2, 4), configs)
    assert probs[0, 0] == pytest.approx(math.e / (math.e + 3))
    assert probs[1, 0] == pytest.approx(math.exp(4) / (math.exp(4) + 3))


def test_top_k_top_p_min_p_filters() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
    logits = probs.log().expand(5, 5)
    configs = [
        SamplingConfig(top_k=2),
        SamplingConfig(top_p=0.69),
        SamplingConfig(top_p=0.71),
        SamplingConfig(min_p=0.3),
        SamplingConfig(top_k=3, top_p=0.8, min_p=0.5),
    ]
    kept = (filtered_probs(logits, configs) > 0).tolist()
    assert kept[0] == [True, True, False, False, False]
    assert kept[1] == [True, True, False, False, False]
    assert kept[2] == [True, True, True, False, False]
    assert kept[3] == [True, True, True, False, False]
    assert kept[4] == [True, True, False, False, False]
    assert filtered_probs(logits, [SamplingConfig(top_p=1e-9)] * 5).gt(0).sum(dim=-1).tolist() == [1] * 5


def test_filtered_tokens_are_never_sampled() -> None:
    logits = random_logits(200, seed=4) * 0.1
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    out = Sampler(0, CPU).sample(logits, [request(sampling) for _ in range(200)])
    top3 = logits.topk(3, dim=-1).indices
    assert all(o.token_id in top3[i].tolist() for i, o in enumerate(out))


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    sampling = SamplingConfig(repetition_penalty=2.0)
    out = apply_penalties(logits, [request(sampling, prompt=(0,), output=(1, 1))])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]
    assert logits.tolist() == [[2.0, -2.0, 2.0, -2.0, 1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 5)
    sampling = SamplingConfig(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [request(sampling, prompt=(3, 3, 4), output=(0, 1, 1, 1))])
    assert out.tolist() == [[-0.75, -1.25, 0.0, 0.0, 0.0]]


def test_penalties_apply_per_row() -> None:
    logits = torch.ones(2, 4)
    reqs = [request(SamplingConfig(), output=(0,)),
            request(SamplingConfig(presence_penalty=1.0), output=(0,))]
    assert apply_penalties(logits, reqs).tolist() == [[1.0] * 4, [0.0, 1.0, 1.0, 1.0]]


def penalise_one(row: torch.Tensor, r: SampleRequest) -> torch.Tensor:
    """One row by the textbook rules, in Python (the batched version must match it bit for bit)."""
    s, out = r.sampling, row.clone()
    ids = [t for t in r.token_ids if 0 <= t < row.shape[0]]
    output = [t for t in r.token_ids[r.num_prompt_tokens:] if 0 <= t < row.shape[0]]
    for t in set(ids):
        out[t] = row[t] / s.repetition_penalty if row[t] > 0 else row[t] * s.repetition_penalty
    for t in set(output):
        out[t] = out[t] - s.frequency_penalty * output.count(t) - s.presence_penalty
    return out


def test_batched_penalties_match_row_by_row() -> None:
    logits = random_logits(4, seed=9)
    reqs = [request(SamplingConfig(repetition_penalty=1.3), prompt=(1, 5, 5), output=(7,)),
            request(SamplingConfig(presence_penalty=0.5, frequency_penalty=0.2), prompt=(2,), output=(3, 3, 9, -1)),
            request(SamplingConfig(), prompt=(4,), output=(4, 4)),
            request(SamplingConfig(repetition_penalty=0.8, frequency_penalty=1.0), prompt=(VOCAB + 3, 0),
                    output=(0, 63, 63))]
    out = apply_penalties(logits, reqs)
    for i, r in enumerate(reqs):
        torch.testing.assert_close(out[i], penalise_one(logits[i], r), rtol=0, atol=1e-6)


def test_logprobs_are_raw_and_ranked() -> None:
    logits = random_logits(3, seed=5)
    raw = torch.log_softmax(logits, dim=-1)
    configs = [
        SamplingConfig(temperature=0.5, repetition_penalty=1.5, logprobs=4, seed=1),
        SamplingConfig(temperature=0.0, logprobs=0),
        SamplingConfig(temperature=0.0),
    ]
    out = Sampler(0, CPU).sample(logits, [request(c, output=(1, 2)) for c in configs])
    assert out[0].logprob == pytest.approx(float(raw[0, out[0].token_id]))
    assert [t for t, _ in out[0].top_logprobs] == raw[0].topk(4).indices.tolist()
    assert [v for _, v in out[0].top_logprobs] == pytest.approx(raw[0].topk(4).values.tolist())
    assert out[1].logprob == pytest.approx(float(raw[1].max())) and out[1].top_logprobs == []
    assert out[2].logprob is None and out[2].top_logprobs == []


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="do not match"):
        Sampler(0, CPU).sample(random_logits(2), [request(SamplingConfig())])
    assert Sampler(0, CPU).sample(torch.empty(0, VOCAB), []) == []


def test_min_tokens_masks_eos_and_stop_tokens_until_enough_are_out() -> None:
    """vLLM's min_tokens: below it, EOS and the request's stop tokens cannot be sampled (greedy or not, whatever
    ignore_eos says); from it on the distribution is the model's again. Ids outside the vocabulary are ignored."""
    eos = (5, 6)
    logits = torch.zeros(8, VOCAB)
    logits[:, 5], logits[:, 6], logits[:, 9], logits[:, 11] = 19.0, 18.0, 17.0, 6.0  # EOS, EOS, stop token 9, then 11
    greedy = SamplingConfig(temperature=0.0, min_tokens=3, stop_token_ids=(9, VOCAB + 4))
    hot = SamplingConfig(temperature=0.3, seed=1, min_tokens=3, stop_token_ids=(9,))
    # position - prompt length = tokens out so far: 0, 2 are below min_tokens 3; 3 is not
    reqs = [request(greedy, position=4, prompt=(1, 2, 3, 4)), request(greedy, position=6, prompt=(1, 2, 3, 4)),
            request(greedy, position=7, prompt=(1, 2, 3, 4)), request(hot, position=4, prompt=(1, 2, 3, 4)),
            request(SamplingConfig(temperature=0.0), position=0), request(hot, position=9, prompt=(1,)),
            request(SamplingConfig(temperature=0.0, min_tokens=2, logprobs=1), position=1, prompt=(1,)),  # EOS only
            request(SamplingConfig(temperature=0.0, min_tokens=1), position=1, prompt=(1,))]
    out = Sampler(0, CPU, eos_token_ids=eos).sample(logits, reqs)
    tokens = [o.token_id for o in out]
    assert tokens[:5] + tokens[6:] == [11, 11, 5, 11, 5, 9, 9] and tokens[5] in (*eos, 9)
    raw = torch.log_softmax(logits[6], dim=-1)  # logprobs stay the raw distribution, as vLLM's raw_logprobs
    assert out[6].logprob == pytest.approx(float(raw[9])) and out[6].top_logprobs[0][0] == 5


def test_min_tokens_zero_keeps_the_greedy_fast_path() -> None:
    logits = random_logits(6, seed=8)
    configs = [SamplingConfig(temperature=0.0, stop_token_ids=tuple(logits.argmax(dim=-1).tolist()))] * 6
    out = Sampler(0, CPU, eos_token_ids=(int(logits[0].argmax()),)).sample(logits, [request(c) for c in configs])
    assert [o.token_id for o in out] == logits.argmax(dim=-1).tolist()
