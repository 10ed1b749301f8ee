"""StepRequest.token_bitmasks, checked and cut into rows: which tokens each constrained request may sample this step.

The executor never trusts them: a malformed set (wrong row width or byte count, a repeated or unknown request id, a
row that allows no token, masks with num_steps > 1 or on a request with draft tokens, where they would hold for the
first position only) refuses the whole step before anything changes. A row is the request's bitmask as bytes, bit j
of byte k (least significant first) standing for token 8 * k + j: the little-endian uint32 words of the contract
read byte by byte.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from executor_service.backend import BatchItem
from executor_service.validator import StepRefused
from protos.pagedserve.v1 import executor_pb2

TokenMasks = dict[str, np.ndarray]
"""request id -> its row: uint8, 4 * words_per_row bytes."""


def words_per_row(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def scheduled_ids(step: executor_pb2.StepRequest) -> set[str]:
    return {n.request_id for n in step.new_requests} | set(step.running.request_ids)


def step_masks(step: executor_pb2.StepRequest, vocab_size: int) -> TokenMasks:
    """The step's rows by request id ({} without masks); StepRefused if they break the contract."""
    if step.token_bitmasks_follow and step.token_bitmasks.request_ids:
        raise StepRefused("token_bitmasks in a step whose masks follow (token_bitmasks_follow)")
    if step.token_bitmasks_follow and max(1, step.num_steps) > 1:
        raise StepRefused("token_bitmasks_follow with num_steps > 1: a mask holds for one sampled token")
    return check_masks(step.token_bitmasks, vocab_size, step, scheduled_ids(step))


def follow_masks(step: executor_pb2.StepRequest, message: executor_pb2.StepRequest, vocab_size: int) -> TokenMasks:
    """The masks a token_bitmasks_follow step's next message carries; StepRefused if it is not that message."""
    if message.step_id != step.step_id:
        raise StepRefused(f"step {step.step_id}'s token masks were to follow, got step {message.step_id}")
    if message.new_requests or message.running.request_ids or message.finished_ids or message.token_bitmasks_follow:
        raise StepRefused("the message after a token_bitmasks_follow step carries token_bitmasks only")
    return check_masks(message.token_bitmasks, vocab_size, step, scheduled_ids(step))


def check_masks(m: executor_pb2.TokenBitmasks, vocab_size: int, step: executor_pb2.StepRequest,
                scheduled: set[str]) -> TokenMasks:
    ids = list(m.request_ids)
    if not ids:
        return {}
    words = words_per_row(vocab_size)
    if m.words_per_row != words:
        raise StepRefused(f"token_bitmasks.words_per_row is {m.words_per_row}; vocab_size {vocab_size} needs {words}")
    if len(m.bitmask) != 4 * words * len(ids):
        raise StepRefused(f"token_bitmasks.bitmask has {len(m.bitmask)} bytes; {len(ids)} rows of {words} words "
                          f"need {4 * words * len(ids)}")
    if len(set(ids)) != len(ids):
        raise StepRefused("token_bitmasks.request_ids names a request more than once")
    if max(1, step.num_steps) > 1:
        raise StepRefused("token_bitmasks with num_steps > 1: a mask holds for one sampled token")
    unknown = next((rid for rid in ids if rid not in scheduled), None)
    if unknown is not None:
        raise StepRefused(f"token_bitmasks names {unknown!r}, which this step does not schedule")
    drafting = {rid for rid, k in zip(step.running.request_ids, step.running.num_draft_tokens, strict=False) if k}
    both = next((rid for rid in ids if rid in drafting), None)
    if both is not None:
        raise StepRefused(f"token_bitmasks names {both!r}, which also carries draft tokens: a mask holds for one "
                          "position, so a constrained request is sent no drafts")
    rows = np.frombuffer(m.bitmask, dtype=np.uint8).reshape(len(ids), 4 * words)
    empty = np.flatnonzero(~allows_some(rows, vocab_size))
    if len(empty):
        raise StepRefused(f"token_bitmasks: the row of {ids[int(empty[0])]!r} allows no token of the vocabulary")
    return dict(zip(ids, rows, strict=True))


class DeferredMasks:
    """A step's masks that follow it (token_bitmasks_follow): the forward pass runs while they travel; the sampler
    waits for them on the forward thread (wait), the event loop hands them over (set) or the failure (fail)."""

    def __init__(self) -> None:
        self._future: Future[TokenMasks] = Future()

    def set(self, masks: TokenMasks) -> None:
        if not self._future.done():
            self._future.set_result(masks)

    def fail(self, error: Exception) -> None:
        if not self._future.done():
            self._future.set_exception(error)

    def wait(self) -> TokenMasks:
        return self._future.result()


def resolve_masks(items: list[BatchItem]) -> None:
    """Items whose masks follow get their rows (blocks until they are in: call it on the forward thread)."""
    for item in items:
        if item.deferred_masks is not None:
            item.token_mask = item.deferred_masks.wait().get(item.request_id)
            item.deferred_masks = None


def allows_some(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """Per row: whether any token of the vocabulary is allowed (bits past vocab_size do not count)."""
    full, rest = divmod(vocab_size, 8)
    some: np.ndarray = np.asarray(rows[:, :full].any(axis=1))
    if rest:
        some |= (rows[:, full] & ((1 << rest) - 1)) != 0
    return some


def unpack_rows(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """[n, vocab_size] booleans: True where the token may be sampled."""
    return np.unpackbits(rows, axis=1, count=vocab_size, bitorder="little").view(bool)


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids one row allows, ascending."""
    return np.flatnonzero(unpack_rows(row[None, :], vocab_size)[0])
