from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason
from scheduler_service.frontend.generation import coalesce


def test_coalesce_merges_per_request_in_order() -> None:
    deltas = [RequestDelta("a", [1]), RequestDelta("b", [7]), RequestDelta("a", [2, 3]),
              RequestDelta("a", [4], FinishReason.LENGTH)]
    merged = {d.request_id: d for d in coalesce(deltas)}
    assert merged["a"].new_token_ids == [1, 2, 3, 4] and merged["a"].finish_reason is FinishReason.LENGTH
    assert merged["b"].new_token_ids == [7] and merged["b"].finish_reason is None
    assert deltas[0].new_token_ids == [1]


def test_a_single_delta_passes_through() -> None:
    d = RequestDelta("a", [1])
    assert coalesce([d]) == [d]
