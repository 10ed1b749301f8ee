"""Pure-torch paged attention over a block-structured KV cache (reference implementation).

Every sequence of a step (decodes and prefill chunks alike) goes through a few padded batched
`scaled_dot_product_attention` calls: sequences are sorted by (query length, context length) and cut into groups
whose padded float32 K/V stay cache-sized on CPU (much larger groups elsewhere). A group's K/V rows are gathered
through one flat slot index; a query head group's rows and the group's query positions share one query axis, so
K/V are never repeated per query head. The plan (groups, slot indices, additive masks) depends only on the step's
metadata, so it is built once per step and reused by every layer when the caller passes a `Scratch`. Math is in
float32. Slots past a sequence's length are never read, so stale or non-finite cache contents cannot leak.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_BYTES = 1 << 21
DEVICE_CHUNK_BYTES = 1 << 28
SCRATCH_MAX_BYTES = 1 << 23
PAD_SLACK = 1.5
MAX_PLANS = 8  # plans a scratch keeps for one step: one per KV cache group whose layers share its window

PlanT = TypeVar("PlanT")


@dataclass(slots=True)
class Group:
    """Sequences attended in one call: query rows padded to q_len, keys padded to kv_len."""

    num_seqs: int
    q_len: int
    kv_len: int
    slots: Tensor  # [num_seqs * kv_len] flat cache slots (padding repeats a sequence's first slot)
    query_rows: Tensor | None  # [num_seqs * q_len] packed query rows (padding repeats a real row); None: all, in order
    bias: Tensor | None  # [num_seqs, 1, group * q_len, kv_len] additive mask (0 / -inf); None: nothing masked
    real: Tensor | None  # positions of real query rows in the padded [num_seqs * q_len] order
    out_rows: Tensor | None  # the packed rows they go to
    fresh_at: Tensor | None = None  # Extras.fresh: the padded key rows [n * kv_len] that are the step's own keys
    fresh_rows: Tensor | None = None  # the packed rows of the step's keys they take


@dataclass(slots=True, frozen=True)
class Extras:
    """What some layers add to plain causal attention: a sliding window (keys visible to a query, itself included),
    soft-capping of the scores (Gemma 2) and attention sinks (GPT-OSS: a logit per query head [heads] that joins
    every softmax's denominator and attends to nothing). `fresh`: the step's own keys and values [num_tokens,
    kv_heads, head_dim] in packed order, read from there instead of the cache (a ring of window blocks, which the
    caller writes only after attending: the step's keys may overwrite keys its own queries read)."""

    window: int | None = None
    softcap: float | None = None
    sinks: Tensor | None = None
    fresh: tuple[Tensor, Tensor] | None = None


@dataclass(slots=True)
class Plan:
    groups: list[Group]
    num_tokens: int


class Scratch:
    """Per-caller state (one forward thread): gather buffers reused across calls (fresh multi-megabyte tensors
    cost more in page faults than the gather itself; requests over SCRATCH_MAX_BYTES get a fresh tensor), and
    the plans of the current step, kept while the caller passes the same metadata tensors (one per layer; one plan
    per KV cache group's block tables)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self._plans: list[tuple[tuple[Tensor, ...], Any]] = []  # the step's plans, one per table set (KV groups)

    def get(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> Tensor:
        numel = shape[0] * shape[1]
        if numel * dtype.itemsize > SCRATCH_MAX_BYTES:
            return torch.empty(shape, dtype=dtype)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = self._buffers[name] = torch.empty(max(numel, SCRATCH_MAX_BYTES // dtype.itemsize // 4),
                                                       dtype=dtype)
        return buffer[:numel].view(shape)

    def plan(self, key: tuple[Tensor, ...], build: Callable[[], PlanT]) -> PlanT:
        """The plan for these metadata tensors (compared by identity; they are held, so ids cannot be reused).
        One kind of plan per scratch: callers with different plan types use different scratches."""
        for held, plan in self._plans:
            if len(held) == len(key) and all(a is b for a, b in zip(key, held, strict=True)):
                return plan
        if len(self._plans) >= MAX_PLANS or not self._plans or not same_step(self._plans[0][0], key):
            self._plans = []  # a new step (or too many tables): the old plans go
        plan = build()
        self._plans.append((key, plan))
        return plan


def same_step(held: tuple[Tensor, ...], key: tuple[Tensor, ...]) -> bool:
    """Two plan keys of one step: the same tensors but the block tables (the first), which each KV group has."""
    return len(held) == len(key) and all(a is b for a, b in zip(held[1:], key[1:], strict=True))


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter key/value [num_tokens, kv_heads, head_dim] into caches at flat slots; slots < 0 are skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    keep = slots >= 0
    if bool(keep.all()):
        k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
        v_flat.index_copy_(0, slots, value.to(v_cache.dtype))
        return
    k_flat[slots[keep]] = key[keep].to(k_cache.dtype)
    v_flat[slots[keep]] = value[keep].to(v_cache.dtype)


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    scratch: Scratch | None = None,
    extras: Extras | None = None,
) -> Tensor:
    """Causal attention of packed query tokens against each sequence's paged KV context.

    query [num_tokens, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim];
    block_tables [num_seqs, max_blocks]; seq_lens [num_seqs] (context including this step's tokens);
    query_start_loc [num_seqs + 1]. The q query tokens of a sequence occupy its last q positions.
    With a scratch, the metadata tensors must not change in place between the calls of one step (and every call
    with that scratch has the same window). `extras`: a sliding window, soft-capping of the scores."""
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return torch.empty_like(query)
    window = None if extras is None else extras.window
    fresh = extras is not None and extras.fresh is not None
    build = functools.partial(build_plan, query, k_cache, block_tables, seq_lens, query_start_loc, None, window,
                              fresh)
    plan = build() if scratch is None else scratch.plan((block_tables, seq_lens, query_start_loc), build)
    if len(plan.groups) == 1 and plan.groups[0].query_rows is None:
        return _attend(query, k_cache, v_cache, plan.groups[0], scale, scratch, extras).to(query.dtype)
    return run_plan(plan, query, k_cache, v_cache, scale, scratch, torch.empty_like(query), extras)


def run_plan(plan: Plan, query: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float, scratch: Scratch | None,
             out: Tensor, extras: Extras | None = None) -> Tensor:
    """Attend every group of the plan into its rows of out (other rows untouched)."""
    for group in plan.groups:
        if group.query_rows is None:
            out.copy_(_attend(query, k_cache, v_cache, group, scale, scratch, extras))
            continue
        attended = _attend(query.index_select(0, group.query_rows), k_cache, v_cache, group, scale, scratch,
                           extras)
        if group.real is not None:
            attended = attended.index_select(0, group.real)
        out.index_copy_(0, group.out_rows, attended.to(out.dtype))  # type: ignore[arg-type]  # set with query_rows
    return out


def build_plan(query: Tensor, k_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
               query_start_loc: Tensor, seqs: list[int] | None = None, window: int | None = None,
               fresh: bool = False) -> Plan:
    """The groups of the named sequences (None: every sequence with query tokens); a query at position p sees
    keys [p - window + 1, p] where `window` is set; `fresh`: the step's own keys are read from Extras.fresh."""
    starts, lens = _host_metadata(query_start_loc, seq_lens)
    q_lens = [starts[s + 1] - starts[s] for s in range(len(lens))]
    order = sorted((s for s in (range(len(lens)) if seqs is None else seqs) if q_lens[s] > 0),
                   key=lambda s: (q_lens[s], lens[s]))
    budget = _chunk_tokens(k_cache)
    group_size = query.shape[1] // k_cache.shape[2]
    chunks = list(_cut(order, q_lens, lens, budget))
    whole = len(chunks) == 1 and len(order) == len(lens) == query.shape[0]  # one decode group: keep packed order
    if whole:
        chunks = [list(range(len(lens)))]
    groups = [_group(chunk, starts, q_lens, lens, block_tables, k_cache.shape[1], group_size, whole, window, fresh)
              for chunk in chunks]
    return Plan(groups, query.shape[0])


def _host_metadata(query_start_loc: Tensor, seq_lens: Tensor) -> tuple[list[int], list[int]]:
    both = torch.cat([query_start_loc.long(), seq_lens.long()]).tolist()
    split = query_start_loc.shape[0]
    return both[:split], both[split:]


def _chunk_tokens(k_cache: Tensor) -> int:
    """Padded context tokens per group: float32 K of a group fits in cache on CPU, in a bound elsewhere."""
    budget = CHUNK_BYTES if k_cache.device.type == "cpu" else DEVICE_CHUNK_BYTES
    return max(1, budget // (k_cache.shape[2] * k_cache.shape[3] * 4))


def _cut(order: list[int], q_lens: list[int], lens: list[int], max_tokens: int) -> Iterator[list[int]]:
    """Cut sequences sorted by (query length, length): padded keys within max_tokens, padded work within
    PAD_SLACK of the real work."""
    chunk: list[int] = []
    q_max = kv_max = real = 0
    for s in order:
        q_new, kv_new, real_new = max(q_max, q_lens[s]), max(kv_max, lens[s]), real + q_lens[s] * lens[s]
        n = len(chunk) + 1
        if chunk and (n * kv_new > max_tokens or n * q_new * kv_new > PAD_SLACK * real_new + n * kv_new):
            yield chunk
            chunk, q_new, kv_new, real_new = [], q_lens[s], lens[s], q_lens[s] * lens[s]
        chunk.append(s)
        q_max, kv_max, real = q_new, kv_new, real_new
    if chunk:
        yield chunk


def _group(chunk: list[int], starts: list[int], q_lens: list[int], lens: list[int], block_tables: Tensor,
           block_size: int, group_size: int, whole: bool, window: int | None = None, fresh: bool = False) -> Group:
    """Index tensors and mask of one group (built once per step on the host, then moved to the device). With a
    window, a sequence's keys start at the first one its first query sees: the blocks before are never read."""
    device = block_tables.device
    n, q_len = len(chunk), max(q_lens[s] for s in chunk)
    seq_q = torch.tensor([q_lens[s] for s in chunk])
    seq_kv = torch.tensor([lens[s] for s in chunk])
    first = torch.zeros_like(seq_kv) if window is None else (seq_kv - seq_q - window + 1).clamp(min=0)
    kv_len = int((seq_kv - first).max())
    key_pos = first[:, None] + torch.arange(kv_len)[None, :]  # [n, kv_len] positions in the sequence
    tables = block_tables.index_select(0, torch.tensor(chunk, device=device)).long().cpu()
    clamped = torch.minimum(key_pos, seq_kv[:, None] - 1)
    slots = (tables.gather(1, clamped // block_size) * block_size + clamped % block_size).flatten()
    q_idx = torch.arange(q_len)
    query_pos = seq_kv[:, None] - seq_q[:, None] + q_idx[None, :]  # [n, q_len]; padding rows past the end
    is_real = q_idx[None, :] < seq_q[:, None]
    keys = key_pos[:, None, :]
    allowed = (keys <= query_pos[:, :, None]) & (keys < seq_kv[:, None, None])
    if window is not None:
        allowed &= keys > query_pos[:, :, None] - window
    allowed[:, :, 0] |= ~is_real  # padding query rows see key 0 only, so they stay finite
    bias = None
    if not bool(allowed.all()):
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None, None]
        if q_len > 1:
            bias = bias.expand(n, 1, group_size, q_len, kv_len).reshape(n, 1, group_size * q_len, kv_len)
        else:
            bias = bias.view(n, 1, 1, kv_len)
    row0 = torch.tensor([starts[s] for s in chunk])  # each sequence's first packed row
    fresh_at, fresh_rows = _fresh_keys(clamped, seq_kv - seq_q, row0) if fresh else (None, None)
    if whole:
        return Group(n, q_len, kv_len, slots.to(device), None, _to(bias, device), None, None,
                     _to(fresh_at, device), _to(fresh_rows, device))
    rows = row0[:, None] + torch.minimum(q_idx[None, :], seq_q[:, None] - 1)
    real = is_real.flatten().nonzero().flatten()
    all_real = real.numel() == n * q_len
    return Group(n, q_len, kv_len, slots.to(device), rows.flatten().to(device), _to(bias, device),
                 None if all_real else real.to(device), rows.flatten()[real].to(device),
                 _to(fresh_at, device), _to(fresh_rows, device))


def _fresh_keys(key_pos: Tensor, step_first: Tensor, row0: Tensor) -> tuple[Tensor, Tensor]:
    """The padded key rows holding positions of the step (from step_first on; key_pos clamped to the sequence, so
    padding repeats its last key, never a ring slot the step has not written yet) and the packed rows whose keys
    they are."""
    at = (key_pos >= step_first[:, None]).flatten().nonzero().flatten()
    rows = (row0[:, None] + key_pos - step_first[:, None]).flatten().index_select(0, at)
    return at, rows


def _to(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


def _attend(query: Tensor, k_cache: Tensor, v_cache: Tensor, group: Group, scale: float,
            scratch: Scratch | None, extras: Extras | None = None) -> Tensor:
    """query [n * q_len, heads, d] in padded order -> attended [n * q_len, heads, d] (float32)."""
    n, q_len, kv_len = group.num_seqs, group.q_len, group.kv_len
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    size = num_heads // num_kv_heads
    key_rows, value_rows = _gather(k_cache, group.slots, "k", scratch), _gather(v_cache, group.slots, "v", scratch)
    if extras is not None and extras.fresh is not None and group.fresh_at is not None:
        _take_fresh(key_rows, extras.fresh[0], group, k_cache.dtype)
        _take_fresh(value_rows, extras.fresh[1], group, v_cache.dtype)
    key = key_rows.view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    value = value_rows.view(n, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    grouped = query.float().view(n, q_len, num_kv_heads, size, head_dim)
    if q_len == 1:
        grouped = grouped.view(n, num_kv_heads, size, head_dim)
    else:
        grouped = grouped.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, size * q_len, head_dim)
    if extras is not None and (extras.softcap is not None or extras.sinks is not None):
        attended = _explicit_attention(grouped, key, value, group, scale, extras)
    else:
        attended = F.scaled_dot_product_attention(grouped, key, value, attn_mask=group.bias, scale=scale)
    if q_len == 1:
        return attended.reshape(n, num_heads, head_dim)
    attended = attended.view(n, num_kv_heads, size, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return attended.reshape(n * q_len, num_heads, head_dim)


def _explicit_attention(query: Tensor, key: Tensor, value: Tensor, group: Group, scale: float,
                        extras: Extras) -> Tensor:
    """Attention written out: scores soft-capped before the mask (cap * tanh(q.k * scale / cap)) and each query
    head's sink logit appended to its scores before the softmax, its probability dropped after."""
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scale)
    if extras.softcap is not None:
        scores = scores.div_(extras.softcap).tanh_().mul_(extras.softcap)
    if group.bias is not None:
        scores = scores + group.bias
    if extras.sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), value)
    n, kv_heads, rows = scores.shape[:3]  # rows: a KV head's query heads, each over q_len positions
    sinks = extras.sinks.float().view(kv_heads, -1, 1).expand(-1, -1, group.q_len).reshape(1, kv_heads, rows, 1)
    probs = torch.softmax(torch.cat([scores, sinks.expand(n, -1, -1, -1)], dim=-1), dim=-1)
    return torch.matmul(probs[..., :-1], value)


def _take_fresh(rows: Tensor, fresh: Tensor, group: Group, cache_dtype: torch.dtype) -> None:
    """Put the step's own keys (or values) into the gathered rows, rounded to the cache's dtype as a write and a
    read of the cache would round them."""
    assert group.fresh_at is not None and group.fresh_rows is not None  # checked by the caller
    taken = fresh.reshape(fresh.shape[0], -1).index_select(0, group.fresh_rows)
    rows.index_copy_(0, group.fresh_at, taken.to(cache_dtype).to(rows.dtype))


def _gather(cache: Tensor, slots: Tensor, name: str, scratch: Scratch | None) -> Tensor:
    """Float32 rows [len(slots), kv_heads * head_dim] of cache at flat slots (into scratch buffers on CPU)."""
    flat = cache.view(cache.shape[0] * cache.shape[1], cache.shape[2] * cache.shape[3])
    if cache.device.type != "cpu" or scratch is None:
        return flat.index_select(0, slots).float()
    shape = (slots.shape[0], flat.shape[1])
    rows = torch.index_select(flat, 0, slots, out=scratch.get(name, cache.dtype, shape))
    return rows if rows.dtype == torch.float32 else scratch.get(f"{name}32", torch.float32, shape).copy_(rows)
