"""FairQueue: round-robin across owners, arrival order within one."""

from __future__ import annotations

from scheduler_service.engine.fair_queue import FairQueue


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (item := q.pop()) is not None:
        out.append(item)
    return out


def test_owners_take_turns_in_arrival_order_of_their_first_item() -> None:
    q: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3", "b1", "b2", "c1"):
        q.push(item[0], item)
    assert len(q) == 6
    assert drain(q) == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert len(q) == 0


def test_an_owner_arriving_while_another_is_served_goes_next() -> None:
    q: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        q.push("a", item)
    assert q.pop() == "a1"
    q.push("b", "b1")  # while a1 runs
    q.push("a", "a4")
    assert drain(q) == ["b1", "a2", "a3", "a4"]


def test_the_served_owners_new_items_keep_its_order() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "a1")
    assert q.pop() == "a1"
    q.push("a", "a2")
    q.push("b", "b1")
    assert drain(q) == ["b1", "a2"]
