"""Speculative decoding in the pure core: the configuration, the n-gram proposer, and the scheduler's drafts,
lookahead slots, budget and variable-length acceptance (random traces: tests/core/test_properties.py and
test_async.py run with speculation among their configurations; the one here always speculates)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import FinishReason, Request, RequestStatus, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.spec_cost import PROBE_EVERY, Probe, StepCosts
from scheduler_service.core.speculative import (
    SpecMethod,
    SpeculativeConfig,
    parse_speculative_config,
    propose_ngram,
)
from tests.support.core_helpers import (
    BLOCK,
    EOS,
    FakeClock,
    TraceSpec,
    check_columns,
    check_invariants,
    config_spec,
    play_trace_step,
    request_spec,
    trace_limits,
    update_and_record,
)
from tests.support.model_executor import ModelExecutor

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=64)
PERIODIC = [10, 11, 12, 13] * 4  # a prompt that repeats: its drafts come from itself


# ---- configuration ------------------------------------------------------------------------------------------

def test_the_flag_reads_vllms_keys() -> None:
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
                                      '"prompt_lookup_max": 4, "disable_by_batch_size": 8}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
            config.disable_by_batch_size) == (5, 2, 4, 8)


@pytest.mark.parametrize(("text", "names"), [
    ("not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative-config.method"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "must be 'ngram' or 'draft_model'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "d"}', "speculative-config.model"),
    ('{"method": "ngram"}', "speculative-config.num_speculative_tokens: required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative-config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "speculative-config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}',
     "speculative-config.prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 2}', "min_acceptance_rate"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}', "unknown key 'draft'"),
])
def test_a_bad_config_is_refused_naming_the_key(text: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        parse_speculative_config(text)


def test_the_scheduler_flag_parses_and_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert SchedulerServiceConfig.from_args([]).speculative_config is None  # off by default
    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    config = SchedulerServiceConfig.from_args(["--speculative-config", flag])
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert config.core().speculative_config == config.speculative_config
    with pytest.raises(SystemExit):
        SchedulerServiceConfig.from_args(["--speculative-config", '{"method": "ngram"}'])
    assert "num_speculative_tokens: required" in capsys.readouterr().err


# ---- the n-gram proposer -------------------------------------------------------------------------------------

def test_the_proposer_copies_what_followed_the_latest_match_of_the_longest_ngram() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]  # "2 3" matches twice (no "5 2 3"): the latest one wins
    assert propose_ngram(tokens, 2, 3, 3) == []  # "5 2 3" never occurred before
    assert propose_ngram([4, 5, 6, 4], 3, 1, 2) == [5, 6, 4]
    assert propose_ngram([4, 5, 6], 3, 1, 2) == []
    assert propose_ngram([4, 5, 4], 0, 1, 2) == []


def test_a_continuation_that_reaches_the_end_repeats_itself() -> None:
    assert propose_ngram([7, 7, 7], 4, 1, 2) == [7, 7, 7, 7]
    assert propose_ngram([1, 2, 1, 2], 5, 2, 2) == [1, 2, 1, 2, 1]


def reference_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The proposer's definition, spelled out: for n from n_max down, the latest window of n tokens ending before
    the last token that equals the last n tokens; what followed it."""
    if k < 1:
        return []
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[len(tokens) - n:]
        ends = [i for i in range(n - 1, len(tokens) - 1) if tokens[i - n + 1:i + 1] == tail]
        if ends:
            start = ends[-1] + 1
            out = tokens[start:start + k]
            while len(out) < k:
                out.append(out[len(out) - (len(tokens) - start)])
            return out
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(0, 6), n_min=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_the_proposer_equals_its_definition(tokens: list[int], k: int, n_min: int, extra: int) -> None:
    assert propose_ngram(tokens, k, n_min, n_min + extra) == reference_ngram(tokens, k, n_min, n_min + extra)


# ---- the scheduler -------------------------------------------------------------------------------------------

def make_scheduler(spec: SpeculativeConfig | None = SPEC, max_drafts: int = 4, blocks: int = 64,
                   **config: object) -> Scheduler:
    cfg = CoreConfig(watermark=0.0, speculative_config=spec, **config)  # type: ignore[arg-type]
    limits = ExecutorLimits(block_size=BLOCK, num_device_blocks=blocks, num_swap_blocks=0, max_model_len=256,
                            eos_token_ids=(EOS,), max_num_draft_tokens=max_drafts)
    return Scheduler(cfg, limits, clock=FakeClock())


def started(s: Scheduler, rid: str = "r", prompt: list[int] | None = None, **sampling: object) -> Request:
    """A request whose prompt is computed and whose first token (the prompt's next period token) is out."""
    request = Request(rid, list(prompt or PERIODIC), SamplingOptions(**sampling), 0.0)  # type: ignore[arg-type]
    s.add_request(request)
    out = s.schedule()
    s.update(out, ExecutorResult(sampled={rid: [10]}))
    return request


def drafts_of(out: SchedulerOutput) -> dict[str, tuple[int, ...]]:
    return {w.request.request_id: w.draft_token_ids for w in out.scheduled if w.draft_token_ids}


def test_a_decode_carries_drafts_in_its_slots_and_budget() -> None:
    s = make_scheduler()
    request = started(s, max_tokens=50)
    out = s.schedule()
    assert drafts_of(out) == {"r": (11, 12, 13)}
    assert out.total_num_scheduled_tokens == 4
    assert len(s.kv.block_table("r")) * BLOCK >= request.num_tokens + 3  # slots for every draft
    assert out.running_requests()[0].draft_token_ids == (11, 12, 13)


def test_accepted_drafts_advance_the_request_by_several_tokens() -> None:
    s = make_scheduler()
    request = started(s, max_tokens=50)
    before = request.num_tokens
    out = s.schedule()
    deltas = list(s.update(out, ExecutorResult(sampled={"r": [11, 12, 99]})))  # two accepted, then the model's
    assert deltas[0].new_token_ids == [11, 12, 99]
    assert request.num_tokens == before + 3 and request.num_computed_tokens == before + 2
    assert s.spec_stats.num_drafts == 1 and s.spec_stats.num_draft_tokens == 3
    assert s.spec_stats.num_accepted_tokens == 2 and s.spec_stats.accepted_per_pos == [1, 1, 0]
    assert request.drafts is not None and request.drafts.mean_accepted_length == 3.0
    check_columns(s)


def test_a_stop_token_inside_an_accepted_run_cuts_it() -> None:
    s = make_scheduler()
    request = started(s, max_tokens=50, stop_token_ids=(12,))
    out = s.schedule()
    deltas = list(s.update(out, ExecutorResult(sampled={"r": [11, 12, 13, 99]})))
    assert deltas[0].new_token_ids == [11, 12] and deltas[0].finish_reason is FinishReason.STOPPED
    assert request.output_token_ids == [10, 11, 12]
    assert s.kv.device.num_free == 64 - len(s.kv._tables)


def test_a_request_whose_drafts_are_rejected_drafts_fewer_and_more_again_once_accepted() -> None:
    """#31 adaptivity: the number of drafts follows the request's recent accepted run (accepted drafts + 1)."""
    s = make_scheduler()
    started(s, max_tokens=60)
    out = s.schedule()
    assert drafts_of(out) == {"r": (11, 12, 13)}
    list(s.update(out, ExecutorResult(sampled={"r": [12]})))  # the first draft rejected: a run of 1
    out = s.schedule()
    assert len(drafts_of(out)["r"]) == 2
    drafts = drafts_of(out)["r"]
    list(s.update(out, ExecutorResult(sampled={"r": [*drafts, 10]})))  # all accepted: a run of 3
    out = s.schedule()
    assert len(drafts_of(out)["r"]) == 3


def test_drafts_never_run_past_max_tokens() -> None:
    s = make_scheduler()
    request = started(s, max_tokens=3)  # one token out: two more, the last one the model's own
    out = s.schedule()
    assert drafts_of(out) == {"r": (11,)}
    deltas = list(s.update(out, ExecutorResult(sampled={"r": [11, 12]})))
    assert deltas[0].finish_reason is FinishReason.LENGTH and request.output_token_ids == [10, 11, 12]


def test_an_executor_without_verification_gets_plain_steps() -> None:
    s = make_scheduler(max_drafts=0)
    started(s, max_tokens=50)
    assert drafts_of(s.schedule()) == {}


DRAFT_MODEL_SPEC = SpeculativeConfig(SpecMethod.DRAFT_MODEL, num_speculative_tokens=3, disable_by_batch_size=64)


def model_drafting_scheduler(max_model_drafts: int) -> Scheduler:
    cfg = CoreConfig(watermark=0.0, speculative_config=DRAFT_MODEL_SPEC)
    limits = ExecutorLimits(block_size=BLOCK, num_device_blocks=64, num_swap_blocks=0, max_model_len=256,
                            eos_token_ids=(EOS,), max_num_draft_tokens=16, max_num_model_draft_tokens=max_model_drafts)
    return Scheduler(cfg, limits, clock=FakeClock())


def test_draft_model_slots_are_reserved_and_any_answer_of_at_most_k_plus_one_tokens_is_accepted() -> None:
    """#31, method draft_model: the scheduler reserves k slots and budget for the executor's draft model (the
    step carries no tokens, only the count) and accepts the run it answers; more than k + 1 tokens fail."""
    s = model_drafting_scheduler(4)
    request = started(s, prompt=[1, 2, 3, 4, 5, 6, 7, 8], max_tokens=50)  # nothing repeats: no n-gram would draft
    out = s.schedule()
    work = out.scheduled[0]
    assert (work.num_model_drafts, work.draft_token_ids, out.total_num_scheduled_tokens) == (3, (), 4)
    assert out.running_requests()[0].num_model_drafts == 3
    assert len(s.kv.block_table("r")) * BLOCK >= request.num_tokens + 3
    deltas = list(s.update(out, ExecutorResult(sampled={"r": [40, 41, 42]})))
    assert deltas[0].new_token_ids == [40, 41, 42] and request.num_computed_tokens == 8 + 1 + 2
    assert (s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (3, 2)
    out = s.schedule()
    assert out.scheduled[0].num_model_drafts == 3
    deltas = list(s.update(out, ExecutorResult(sampled={"r": [1, 2, 3, 4, 5]})))
    assert deltas[0].finish_reason is FinishReason.ERROR and "do not verify the 3 drafts" in deltas[0].error
    assert s.kv.device.num_free == 64


def test_draft_model_without_the_executors_capability_gets_plain_steps() -> None:
    s = model_drafting_scheduler(0)  # the executor verifies n-gram drafts but has no draft model
    started(s, max_tokens=50)
    out = s.schedule()
    assert [(w.num_model_drafts, w.draft_token_ids) for w in out.scheduled] == [(0, ())]


@pytest.mark.parametrize(("batch_size", "drafted"), [(1, set()), (2, {"a", "b"})])
def test_speculation_stops_above_the_batch_size(batch_size: int, drafted: set[str]) -> None:
    s = make_scheduler(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                         disable_by_batch_size=batch_size))
    for rid in ("a", "b"):
        s.add_request(Request(rid, list(PERIODIC), SamplingOptions(max_tokens=50), 0.0))
    out = s.schedule()
    s.update(out, ExecutorResult(sampled={"a": [10], "b": [10]}))
    assert set(drafts_of(s.schedule())) == drafted


def test_a_request_whose_drafts_fail_pauses_speculating() -> None:
    s = make_scheduler(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, min_acceptance_rate=0.5))
    started(s, max_tokens=200)
    drafted = 0
    for _ in range(12):
        out = s.schedule()
        drafted += bool(drafts_of(out))
        s.update(out, ExecutorResult(sampled={"r": [50]}))  # every draft rejected
    assert 0 < drafted < 6, "it stopped proposing after its drafts kept failing"


def test_the_budget_trims_drafts_and_never_preempts_for_them() -> None:
    s = make_scheduler()
    started(s, max_tokens=50)
    s.config.max_num_batched_tokens = 3
    assert drafts_of(s.schedule()) == {"r": (11, 12)}
    s = make_scheduler(blocks=5)  # the prompt and the first token fill 5 blocks: no room for draft slots
    started(s, prompt=[*PERIODIC, 10, 11, 12], max_tokens=50)
    out = s.schedule()
    assert drafts_of(out) == {} and [w.num_tokens for w in out.scheduled] == [1]


def test_an_answer_that_does_not_verify_the_drafts_fails_the_request() -> None:
    s = make_scheduler()
    started(s, max_tokens=50)
    out = s.schedule()
    deltas = list(s.update(out, ExecutorResult(sampled={"r": [11, 50, 12, 13, 14]})))
    assert deltas[0].finish_reason is FinishReason.ERROR and "do not verify" in deltas[0].error
    assert s.kv.device.num_free == 64


def test_async_a_request_with_drafts_in_flight_waits_for_them() -> None:
    s = make_scheduler(async_scheduling=True)
    request = started(s, max_tokens=50)
    first = s.schedule()
    assert drafts_of(first) == {"r": (11, 12, 13)}
    assert s.schedule().scheduled == [], "how many tokens its step keeps is not known yet"
    s.update(s._unupdated[1], ExecutorResult())
    s.update(first, ExecutorResult(sampled={"r": [11, 12, 13, 10]}))
    assert request.output_token_ids == [10, 11, 12, 13, 10]
    assert drafts_of(s.schedule()) == {"r": (11, 12, 13)}


def test_a_preempted_request_gives_back_its_draft_tokens_budget() -> None:
    s = make_scheduler(blocks=6, max_num_batched_tokens=64)
    started(s, "a", max_tokens=50)
    started(s, "b", prompt=[20, 21, 22, 23] * 2, max_tokens=50)
    out = s.schedule()
    check_invariants(s, out, s.config, {})
    assert out.total_num_scheduled_tokens <= 64
    if out.num_preempted:
        assert all(w.request.status is RequestStatus.RUNNING for w in out.scheduled)


# ---- random traces, always speculating ------------------------------------------------------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=10), cfg_kwargs=config_spec,
       device_blocks=st.integers(5, 40), cpu_blocks=st.integers(0, 30), k=st.integers(1, 4))
def test_speculative_traces_give_the_undisturbed_tokens(specs: list[TraceSpec], cfg_kwargs: dict[str, object],
                                                        device_blocks: int, cpu_blocks: int, k: int) -> None:
    """Against the KV-checking executor model (a rejected draft's slot is never read: the model checks every
    computed slot before each forward, and a slot holding a rejected draft names tokens the request never had):
    each request's tokens equal a run without speculation, and every block comes back."""
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=64, min_acceptance_rate=0.0)
    plain, plain_reasons, _ = drive_trace(specs, CoreConfig(**{**cfg_kwargs, "speculative_config": None}),  # type: ignore[arg-type]
                                          device_blocks, cpu_blocks)
    outputs, reasons, s = drive_trace(specs, CoreConfig(**{**cfg_kwargs, "speculative_config": spec}),  # type: ignore[arg-type]
                                      device_blocks, cpu_blocks)
    event(f"drafts accepted: {s.spec_stats.num_accepted_tokens > 0}")
    event(f"drafts rejected: {s.spec_stats.num_accepted_tokens < s.spec_stats.num_draft_tokens}")
    for rid, reason in reasons.items():
        spec_of = specs[int(rid[1:].split(".")[0])]
        if spec_of[5] or spec_of[10] or FinishReason.ERROR in (reason, plain_reasons[rid]):
            continue  # ended at a fixed step (abort, stop string; the runs are elsewhere by then), or failed
        assert (outputs[rid], reason) == (plain[rid], plain_reasons[rid]), rid


def drive_trace(specs: list[TraceSpec], cfg: CoreConfig, device_blocks: int,
                cpu_blocks: int) -> tuple[dict[str, list[int]], dict[str, FinishReason], Scheduler]:
    clock = FakeClock()
    limits = trace_limits(device_blocks, cpu_blocks)
    s = Scheduler(cfg, limits, clock=clock)
    ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    for step in range(800):
        clock.now = step * 0.01
        for request in play_trace_step(s, specs, step, clock.now, reasons):
            outputs[request.request_id] = []
        before = {r.request_id: list(s.kv.block_table(r.request_id)) for r in s.running}
        out = s.schedule()
        check_invariants(s, out, cfg, before)
        check_columns(s)
        update_and_record(s, out, ex.step(out), outputs, reasons)
        for r in s.running:  # at most the drafts' room beyond what it holds: no block leaks into a table
            need = r.num_tokens + cfg.num_lookahead_slots + cfg.num_scheduler_steps - 1
            assert len(s.kv.block_table(r.request_id)) <= s.kv.blocks_for(need + 4), r.request_id
        if step > max(sp[0] for sp in specs) and not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert s.kv.device.num_free == device_blocks and s.kv.cpu.num_free == cpu_blocks
    return outputs, reasons, s


def test_async_a_request_whose_tokens_predict_a_draft_waits_for_its_step_then_drafts() -> None:
    s = make_scheduler(async_scheduling=True)
    request = Request("r", list(PERIODIC), SamplingOptions(max_tokens=50), 0.0)
    s.add_request(request)
    prefill = s.schedule()
    decode = s.schedule()  # the first token is being sampled: decoded ahead, nothing to draft from
    assert [w.num_tokens for w in decode.scheduled] == [1] and not drafts_of(decode)
    s.update(prefill, ExecutorResult(sampled={"r": [10]}))
    waits = s.schedule()  # "13 10" predicts 11 for the token in flight: it waits for it instead of decoding ahead
    assert waits.scheduled == []
    s.update(decode, ExecutorResult(sampled={"r": [11]}))
    s.update(waits, ExecutorResult())
    assert drafts_of(s.schedule()) == {"r": (12, 13, 10)}


def test_async_wrong_guesses_pause_the_waiting() -> None:
    s = make_scheduler(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, min_acceptance_rate=0.5),
                       async_scheduling=True)
    s.add_request(Request("r", list(PERIODIC), SamplingOptions(max_tokens=200), 0.0))
    pending = [s.schedule()]
    waited = 0
    for _ in range(30):
        out = s.schedule()
        waited += not out.scheduled
        first = pending.pop(0)
        s.update(first, ExecutorResult(sampled={"r": [50]} if first.scheduled else {}))  # never what it guessed
        pending.append(out)
    assert 0 < waited < 8, "after its guesses kept failing it decoded ahead again"


# ---- speculation by measured cost (spec_cost.py) -------------------------------------------------------------

def test_step_costs_learn_a_rows_and_a_drafts_seconds_and_probe_stale_ones() -> None:
    costs = StepCosts()
    assert costs.probe(8) is Probe.NONE and costs.clears(8, 0.0, 4, True)  # nothing reported: speculation is on
    costs.observe_step(8, 0, 0.008)
    assert costs.of(8).token_s == pytest.approx(0.001) and costs.probe(8) is Probe.DRAFTS  # no draft measured
    costs.observe_step(8, 16, 0.016)
    assert costs.of(8).draft_s == pytest.approx(0.0005) and costs.probe(8) is Probe.NONE
    assert costs.value_s(8, 2.0, 4) == pytest.approx(2 * 0.001 - 4 * 0.0005)
    assert costs.clears(8, 1.5, 2, was_on=True) and not costs.clears(8, 1.1, 2, was_on=False)  # hysteresis
    assert costs.probe(16) is Probe.PLAIN and costs.pays_at_all(16)  # another batch size: its own costs
    costs.observe_step(64, 0, 0.064)
    costs.observe_step(64, 64, 0.064 + 64 * 0.002)
    assert not costs.pays_at_all(64)  # a draft costs more than a plain token: none can pay
    for _ in range(PROBE_EVERY):
        costs.observe_step(64, 0, 0.064)
    assert costs.probe(64) is Probe.DRAFTS


def spec_scheduler(**config: object) -> Scheduler:
    cfg = CoreConfig(**{"watermark": 0.0, "speculative_config": SPEC, **config})  # type: ignore[arg-type]
    limits = ExecutorLimits(block_size=BLOCK, num_device_blocks=512, num_swap_blocks=0, max_model_len=2048,
                            eos_token_ids=(EOS,), max_num_draft_tokens=4)
    return Scheduler(cfg, limits, clock=FakeClock())


def timed_step(s: Scheduler, answer: dict[str, list[int]], busy: Callable[[int, int], float]) -> SchedulerOutput:
    """One step: each request answers its accepted drafts then answer[rid] (default: every draft accepted, then
    the prompt's period continued), the executor reporting busy(batch, drafts) seconds."""
    out = s.schedule()
    sampled: dict[str, list[int]] = {}
    for w in out.scheduled:
        rid = w.request.request_id
        if rid in answer:
            sampled[rid] = answer[rid]
        else:
            tokens = w.request.all_token_ids
            sampled[rid] = [*w.draft_token_ids, PERIODIC[(len(tokens) + len(w.draft_token_ids)) % 4]]
    s.update(out, ExecutorResult(sampled=sampled, busy_s=busy(len(out.scheduled), out.total_num_scheduled_tokens
                                                              - len(out.scheduled))))
    return out


def test_drafts_stop_where_a_verification_costs_more_than_they_save_and_come_back_once_it_is_cheap() -> None:
    s = spec_scheduler()
    started(s, max_tokens=1500)
    dear = list(map(bool, (drafts_of(timed_step(s, {}, lambda b, d: 0.010 + d * 0.012)) for _ in range(96))))
    assert dear[:3] == [True, False, True]  # unmeasured: speculate; then probe a plain step and a verification
    assert sum(dear[3:]) <= 3  # a draft costs more than the token it could save: only a probe now and then
    cheap = [bool(drafts_of(timed_step(s, {}, lambda b, d: 0.010))) for _ in range(160)]
    assert sum(cheap[-40:]) >= 38  # a verification costs a plain step again: every step drafts (but a probe)


def test_speculation_that_is_not_adaptive_drafts_every_step_whatever_it_costs() -> None:
    s = spec_scheduler(speculative_config=replace(SPEC, adaptive=False))
    started(s, max_tokens=1500)
    dear = [bool(drafts_of(timed_step(s, {}, lambda b, d: 0.010 + d * 0.012))) for _ in range(64)]
    assert all(dear)  # the adaptive scheduler drafts in at most a few of these (the test above)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}') \
        == SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
    with pytest.raises(ValueError, match=r"speculative-config\.adaptive: must be true or false"):
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": 0}')


def test_a_request_whose_drafts_do_not_pay_stops_and_its_scored_guesses_bring_it_back() -> None:
    s = spec_scheduler()
    good, bad = (Request(rid, list(PERIODIC), SamplingOptions(max_tokens=1500), 0.0) for rid in ("good", "bad"))
    s.add_request(good)
    s.add_request(bad)
    s.update(s.schedule(), ExecutorResult(sampled={"good": [10], "bad": [10]}))
    cost = lambda b, d: 0.010 + d * 0.0035  # noqa: E731 - a row is worth 5 ms, a draft costs 3.5 ms

    def step(bad_copies: bool) -> dict[str, tuple[int, ...]]:
        """good: every draft accepted; bad: the token after its accepted drafts is what its n-gram predicts
        (bad_copies) or never that (its first draft and every guess rejected)."""
        out = s.schedule()
        drafts = drafts_of(out)
        mine = [*bad.all_token_ids, *drafts.get("bad", ())]
        predicted = (propose_ngram(mine, 1, 1, 3) or [10])[0]
        own = predicted if bad_copies else 10 + (predicted - 9) % 4
        accepted = drafts.get("bad", ()) if bad_copies else ()
        sampled = {"good": [*drafts.get("good", ()), PERIODIC[(good.num_tokens + len(drafts.get("good", ()))) % 4]],
                   "bad": [*accepted, own]}
        s.update(out, ExecutorResult(sampled=sampled, busy_s=cost(2, sum(map(len, drafts.values())))))
        return drafts

    first = [step(bad_copies=False) for _ in range(60)]
    assert sum("good" in d for d in first[-40:]) >= 38  # the good one drafts on (but for a plain probe)
    assert sum("bad" in d for d in first[-40:]) == 0 and bad.drafts is not None and not bad.drafts.on
    assert sum(1 for d in first if "bad" in d) <= 2  # it stopped after its first rejections
    then = [step(bad_copies=True) for _ in range(60)]  # now its text repeats: its n-gram's guesses come true
    assert sum("bad" in d for d in then[-20:]) >= 18 and bad.drafts.on
    check_columns(s)


def test_async_drafts_that_save_less_than_the_turnaround_they_cost_are_not_sent() -> None:
    clock = FakeClock()
    cfg = CoreConfig(watermark=0.0, speculative_config=SPEC, async_scheduling=True)
    limits = ExecutorLimits(block_size=BLOCK, num_device_blocks=512, num_swap_blocks=0, max_model_len=2048,
                            eos_token_ids=(EOS,), max_num_draft_tokens=4)
    s = Scheduler(cfg, limits, clock=clock)
    request = started(s, max_tokens=1500)
    drafted = []
    for _ in range(80):
        out = s.schedule()
        clock.now += 0.050  # a lone step's round trip: 1 ms in the executor, 49 ms around it
        drafts = drafts_of(out).get("r", ())
        tokens = request.all_token_ids
        s.update(out, ExecutorResult(sampled={"r": [*drafts, PERIODIC[(len(tokens) + len(drafts)) % 4]]}
                                     if out.scheduled else {}, busy_s=0.001 if out.scheduled else 0.0))
        drafted.append(bool(drafts))
    assert s.spec_costs.turnaround_s(1) == pytest.approx(0.049)
    assert sum(drafted[-40:]) <= 2  # 3 tokens of 1 ms each never pay 49 ms: only probes


def test_async_a_request_waits_for_its_step_in_flight_only_if_its_drafts_pay_for_the_lost_step() -> None:
    s = make_scheduler(async_scheduling=True)
    s.spec_costs.observe_step(1, 0, 0.010)  # a row is worth 10 ms
    s.spec_costs.observe_step(1, 3, 0.010 + 3 * 0.0075)  # a draft costs 7.5 ms
    s.spec_costs.observe_gain(3)  # drafts here are accepted: 3 drafts save 30 ms, cost 22.5 ms
    request = Request("r", list(PERIODIC), SamplingOptions(max_tokens=50), 0.0)
    s.add_request(request)
    prefill = s.schedule()
    decode = s.schedule()
    s.update(prefill, ExecutorResult(sampled={"r": [10]}))
    ahead = s.schedule()  # waiting for the token in flight would give up 10 ms more: 30 < 22.5 + 10
    assert [w.num_tokens for w in ahead.scheduled] == [1] and not drafts_of(ahead)
    s.update(decode, ExecutorResult(sampled={"r": [11]}))
    s.update(ahead, ExecutorResult(sampled={"r": [12]}))
    assert drafts_of(s.schedule()) == {"r": (13, 10, 11)}  # nothing in flight: its drafts pay
