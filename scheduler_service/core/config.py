"""The scheduler core's knobs and the executor's sizes it schedules against."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field

from client.flags import flag
from scheduler_service.core.policy import Policy
from scheduler_service.core.speculative import SpeculativeConfig, parse_speculative_config


class PreemptionMode(enum.Enum):
    AUTO = "auto"
    SWAP = "swap"
    RECOMPUTE = "recompute"


class Victim(enum.Enum):
    LATEST = "latest"
    LONGEST = "longest"


def speculative_flag(text: str) -> SpeculativeConfig:
    """--speculative-config's value; argparse prints the message of a bad one."""
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(slots=True)
class CoreConfig:
    """The scheduler core's knobs; each is also a flag of `python -m scheduler_service` (client/flags.py)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: Policy = Policy.FCFS
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    preemption_victim: Victim = Victim.LATEST
    watermark: float = 0.01
    scheduler_delay_factor: float = 0.0
    num_lookahead_slots: int = 0
    num_scheduler_steps: int = 1
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "reuse the KV of cached full blocks of a prompt's prefix (on by default)"))
    long_prefill_token_threshold: int = 0
    aging_rate: float = field(default=0.0, metadata=flag("priority units gained per second of waiting (sjf, priority)"))
    max_waiting_time: float | None = field(default=None, metadata=flag(
        "seconds after which a waiting request goes to the head of the queue"))
    async_scheduling: bool = False
    speculative_config: SpeculativeConfig | None = field(default=None, metadata=flag(
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": N, '
        '"prompt_lookup_max": M} (also disable_by_batch_size, min_acceptance_rate), or {"method": "draft_model", '
        '"num_speculative_tokens": K} with an executor started with --draft-model DIR; off by default',
        parse=speculative_flag))


@dataclass(slots=True, frozen=True)
class ExecutorLimits:
    block_size: int
    num_device_blocks: int
    num_swap_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_num_draft_tokens: int = 0  # draft tokens the executor verifies per request and step (0: none)
    num_window_groups: int = 0  # sliding-window KV cache groups the executor keeps tables for (0: one table)
    window: int = 0  # the keys a query of those groups reads (Describe.capabilities.kv_window)
    window_ring: bool = False  # window tables are rings of ceil(window / block_size) + 1 blocks (kv_window_ring)
    window_only: bool = False  # every layer slides: one window group and no full-attention table (kv_window_only)
    max_num_model_draft_tokens: int = 0  # tokens the executor's draft model proposes per request and step (0: none)
