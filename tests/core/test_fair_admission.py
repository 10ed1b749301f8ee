"""Admission takes turns between owners (API keys): one key's flood of the waiting queue delays another key's
request by at most one admission per key waiting, under every policy's own order; one owner alone sees the
policy's order unchanged. Targeted cases on the scheduler, and random operation sequences on the queue."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.policy import Policy, WaitingQueue
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import FakeClock, make_request
from tests.support.model_executor import ModelExecutor


def admissions(policy: Policy, requests: list[Request], **config: object) -> list[str]:
    """Admit one request per step (max_num_seqs=1, max_tokens=1): the order they ran in."""
    cfg = CoreConfig(watermark=0.0, max_num_seqs=1, policy=policy, **config)  # type: ignore[arg-type]
    limits = ExecutorLimits(block_size=16, num_device_blocks=64, num_swap_blocks=0, max_model_len=4096,
                            eos_token_ids=(2,))
    clock = FakeClock()
    s = Scheduler(cfg, limits, clock=clock)
    executor = ModelExecutor(64, 1, 16)
    for request in requests:
        s.add_request(request)
    clock.now = max(r.arrival_time for r in requests)
    order: list[str] = []
    while s.has_unfinished():
        out = s.schedule()
        order += [w.request.request_id for w in out.scheduled]
        s.update(out, executor.step(out))
    return order


def owned(rid: str, owner: str, arrival: float, **sampling: object) -> Request:
    request = make_request(rid, 8, max_tokens=1, arrival=arrival, ignore_eos=True, **sampling)
    request.owner = owner
    return request


def test_a_second_keys_request_is_admitted_before_the_first_keys_flood_drains() -> None:
    flood = [owned(f"a{i}", "key-a", float(i)) for i in range(10)]
    order = admissions(Policy.FCFS, [*flood, owned("b0", "key-b", 20.0)])
    assert order.index("b0") == 1, order  # FCFS alone: 10th, behind the whole flood
    assert [rid for rid in order if rid != "b0"] == [f"a{i}" for i in range(10)]  # each key's own order kept


def test_keys_take_turns_each_in_its_own_arrival_order() -> None:
    requests = [owned(f"a{i}", "key-a", float(i)) for i in range(4)]
    requests += [owned(f"b{i}", "key-b", 10.0 + i) for i in range(2)]
    requests += [owned("c0", "key-c", 20.0)]
    assert admissions(Policy.FCFS, requests) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_one_owner_alone_is_served_in_the_order_it_queued() -> None:
    requests = [owned(f"r{i}", "", float(i)) for i in range(6)]
    assert admissions(Policy.FCFS, requests) == [f"r{i}" for i in range(6)]


def test_priority_stays_absolute_and_keys_take_turns_within_a_priority() -> None:
    requests = [owned(f"a{i}", "key-a", float(i), priority=0) for i in range(4)]
    requests += [owned("b-low", "key-b", 5.0, priority=1), owned("b0", "key-b", 6.0, priority=0)]
    order = admissions(Policy.PRIORITY, requests)
    assert order == ["a0", "b0", "a1", "a2", "a3", "b-low"], order


def test_the_max_waiting_time_guard_still_sends_the_oldest_first() -> None:
    requests = [owned("b-old", "key-b", 0.0, priority=9), *(owned(f"a{i}", "key-a", 50.0, priority=0)
                                                            for i in range(3))]
    order = admissions(Policy.PRIORITY, requests, max_waiting_time=10.0)
    assert order[0] == "b-old", order


# ---- random operation sequences on the queue ------------------------------------------------------------------

OWNERS = ["", "key-a", "key-b", "key-c"]
operation = st.one_of(
    st.tuples(st.just("push"), st.sampled_from(OWNERS), st.booleans(), st.integers(0, 3)),  # front?, priority
    st.tuples(st.just("admit"), st.just(""), st.just(False), st.just(0)),  # the request peek() names
    st.tuples(st.just("abort"), st.just(""), st.just(False), st.integers(0, 50)),  # any waiting one
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(operation, max_size=80), policy=st.sampled_from(list(Policy)))
def test_random_operations_admit_every_request_once_and_no_owner_waits_behind_two_of_another(
        ops: list[tuple[str, str, bool, int]], policy: Policy) -> None:
    """Whatever is pushed, admitted and aborted: the queue names only waiting requests, admits each one once,
    and while an owner has a request waiting (not pushed to the front), no other owner is admitted twice at
    one priority before it; a single owner's requests come in the policy's order."""
    queue = WaitingQueue(policy)
    waiting: dict[str, Request] = {}
    admitted: list[Request] = []
    served_since: dict[str, dict[str, int]] = {}  # owner waiting -> admissions of each other owner since
    for i, (op, owner, front, value) in enumerate(ops):
        if op == "push":
            request = owned(f"r{i}", owner, float(i), priority=value)
            if all(r.owner != owner for r in waiting.values()):
                served_since[owner] = {}  # it starts waiting now
            queue.push(request, front=front and policy is Policy.FCFS)
            waiting[request.request_id] = request
        elif op == "abort" and waiting:
            request = waiting.pop(sorted(waiting)[value % len(waiting)])
            queue.discard(request)
            request.status = RequestStatus.FINISHED
        elif op == "admit" and waiting:
            chosen = queue.peek(float(i))
            assert chosen is not None and waiting.pop(chosen.request_id) is chosen
            best = min(r.sampling.priority for r in waiting.values()) if waiting else chosen.sampling.priority
            if policy is Policy.PRIORITY:
                assert chosen.sampling.priority <= best
            queue.discard(chosen, admitted=True)
            chosen.status = RequestStatus.RUNNING
            admitted.append(chosen)
            check_turns(served_since, chosen, waiting, policy, any(front for *_, front, _ in ops[:i]))
        assert len(queue) == len(waiting)
        assert (queue.peek(float(i)) is None) == (not waiting)
        assert set(queue.owners_waiting()) == {r.owner for r in waiting.values()}
    assert len({r.request_id for r in admitted}) == len(admitted)


def check_turns(served_since: dict[str, dict[str, int]], request: Request, waiting: dict[str, Request],
                policy: Policy, fronts: bool) -> None:
    """No owner admitted twice while another waits with an equal claim (under sjf keys differ: not checked)."""
    served_since[request.owner] = {}
    owners_waiting = {r.owner for r in waiting.values()}
    for owner, counts in served_since.items():
        if owner == request.owner or owner not in owners_waiting:
            counts.clear()
            continue
        tied = policy is Policy.FCFS or (policy is Policy.PRIORITY and any(
            r.owner == owner and r.sampling.priority == request.sampling.priority for r in waiting.values()))
        if not tied:
            counts.clear()
            continue
        counts[request.owner] = counts.get(request.owner, 0) + 1
        if not fronts:
            assert counts[request.owner] <= 1, (owner, request.owner, counts)


def test_an_owner_arriving_after_an_admission_goes_before_the_owner_just_admitted() -> None:
    """Turns count in admissions: key B's first request, arriving after key A's was admitted, is next, not behind
    another of A's (A alone was at the head of the turns)."""
    queue = WaitingQueue(Policy.FCFS)
    flood = [owned(f"a{i}", "key-a", float(i)) for i in range(3)]
    for request in flood:
        queue.push(request)
    first = queue.peek(3.0)
    assert first is flood[0]
    queue.discard(first, admitted=True)
    first.status = RequestStatus.RUNNING
    late = owned("b0", "key-b", 4.0)
    queue.push(late)
    assert queue.peek(4.0) is late
