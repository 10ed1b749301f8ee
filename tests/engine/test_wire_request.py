"""A request crosses the front-end -> engine core link whole: who sent it and its cache scope included."""

from __future__ import annotations

from scheduler_service.core.request import Request, SamplingOptions
from scheduler_service.messages import ToCore, encoder, new_request, request_from, to_core_decoder


def test_a_request_keeps_its_scope_owner_and_tokens_across_the_link() -> None:
    sent = Request("owner:r1", [1, 2, 3], SamplingOptions(max_tokens=7, seed=5), 12.5, output_len_hint=9,
                   output_token_ids=[4], share_prompt_with="owner:r0", cache_salt="salt", tenant="t" * 32,
                   owner="o" * 32)
    wire = to_core_decoder.decode(encoder.encode(ToCore(new=[new_request(sent, stop_strings=True)])))
    (msg,) = wire.new
    assert msg.stop_strings and msg.resume  # it carries output tokens: a continuation
    got = request_from(msg, clock_offset=0.5)
    for name in ("request_id", "prompt_token_ids", "sampling", "output_len_hint", "output_token_ids",
                 "share_prompt_with", "cache_salt", "tenant", "owner"):
        assert getattr(got, name) == getattr(sent, name), name
    assert got.arrival_time == 13.0
