"""A model-free executor backend: deterministic tokens, configurable latency, no weights."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np

from executor_service.backend import BackendInfo, BatchItem, PromptLogprobs, SampleOutput
from executor_service.config import ExecutorConfig
from executor_service.seeding import splitmix64
from executor_service.token_masks import allowed_ids
from executor_service.validator import MAX_NUM_DRAFT_TOKENS
from protos.contract import BlockMap

PRINTABLE_LOW, PRINTABLE_HIGH = 32, 127
PROMPT_LOGPROB_STEPS = 2000
"""A simulated prompt logprob is one of these steps of 1/200 below 0: in (-10, 0]."""


class SimulatedBackend:
    """Token at position p of a request is a function of (seed or request id, p) only."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.info = BackendInfo(
            model_id="simulated", vocab_size=config.sim_vocab_size, eos_token_ids=(config.sim_eos_token_id,),
            max_model_len=config.max_model_len or config.sim_max_model_len, block_size=config.block_size,
            num_device_blocks=config.num_gpu_blocks if config.num_gpu_blocks is not None else 4096,
            num_swap_blocks=config.num_cpu_blocks if config.num_cpu_blocks is not None else 4096,
            dtype="none", device="simulated", max_num_draft_tokens=MAX_NUM_DRAFT_TOKENS,
            kv_window_groups=config.sim_kv_window_groups if config.sim_kv_window > 0 else 0,
            kv_window=config.sim_kv_window if config.sim_kv_window_groups > 0 else 0,
            kv_window_ring=config.sim_kv_window_ring and config.sim_kv_window_groups > 0 and config.sim_kv_window > 0,
            kv_window_only=config.sim_kv_window_only and config.sim_kv_window_ring and config.sim_kv_window_groups == 1
            and config.sim_kv_window > 0)

    def swap_out(self, mapping: BlockMap) -> None:
        pass

    def swap_in(self, mapping: BlockMap) -> None:
        pass

    def copy(self, mapping: BlockMap) -> None:
        pass

    def delay_s(self, num_tokens: int) -> float:
        return self.config.sim_step_latency_ms / 1e3 + num_tokens * self.config.sim_token_latency_us / 1e6

    def _key(self, item: BatchItem) -> int:
        """The seed, else a key from the request id, worked out at each sample: nothing is kept per request (a
        dict of them grew by ~150 bytes a request until it held a million)."""
        if item.sampling.seed is not None:
            return item.sampling.seed
        return zlib.crc32(item.request_id.encode()) | (1 << 40)

    def token_at(self, item: BatchItem, position: int) -> int:
        """The token at `position`; below min_tokens never EOS or a stop token (the next printable one instead)."""
        h = splitmix64(self._key(item), position)
        masked = item.sampling.masked_ids(position - item.num_prompt_tokens, self.info.eos_token_ids)
        if (self.config.sim_eos_rate > 0 and (h >> 32) / 2**32 < self.config.sim_eos_rate
                and self.config.sim_eos_token_id not in masked):
            return self.config.sim_eos_token_id
        span = PRINTABLE_HIGH - PRINTABLE_LOW
        for k in range(span):
            token = PRINTABLE_LOW + (h + k) % span
            if token not in masked:
                return token
        return next(t for t in range(self.info.vocab_size) if t not in masked)

    def execute(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        for item in items:
            positions = item.prompt_positions()
            if positions:
                item.prompt_out = PromptLogprobs(positions.start, [self.prompt_logprob(item, p) for p in positions])
        return [self.sample(i) if i.sample else None for i in items]

    @staticmethod
    def prompt_logprob(item: BatchItem, position: int) -> SampleOutput:
        """A prompt token's simulated logprob: a function of the token, the one before it and the position only
        (the same for every request with that prompt, chunked or not), in (-10, 0]; its only alternative is
        itself."""
        token = item.token_ids[position]
        h = splitmix64(item.token_ids[position - 1] << 32 | token, position)
        logprob = -(h % PROMPT_LOGPROB_STEPS) / 200
        top = [(token, logprob)] if item.sampling.prompt_logprobs else []
        return SampleOutput(token, logprob, top)

    async def execute_async(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        samples = self.execute(items)
        delay = self.delay_s(sum(i.num_tokens + len(i.draft_token_ids) for i in items))
        if delay > 0:
            await asyncio.sleep(delay)
        return samples

    def sample(self, item: BatchItem) -> SampleOutput:
        """The simulated model puts all probability on one token: with logprobs asked, that token has
        logprob 0 and is the only alternative with a probability above zero. Under a token mask its token is the
        allowed one the position's hash picks (EOS only when the mask allows it); a masked item has no drafts."""
        run = [self.output(item, len(item.token_ids))]
        drafts = item.draft_token_ids
        while len(run) <= len(drafts) and run[-1].token_id == drafts[len(run) - 1]:  # verified as the torch one
            run.append(self.output(item, len(item.token_ids) + len(run)))
        run[0].extra = run[1:]
        return run[0]

    def output(self, item: BatchItem, position: int) -> SampleOutput:
        token = self.token_at(item, position)
        if item.token_mask is not None and position == len(item.token_ids):
            allowed = allowed_ids(item.token_mask, self.info.vocab_size)
            masked = item.sampling.masked_ids(position - item.num_prompt_tokens, self.info.eos_token_ids)
            kept = np.setdiff1d(allowed, masked) if masked else allowed
            allowed = kept if len(kept) else allowed  # min_tokens gives way where the grammar allows nothing else
            if token not in allowed:
                token = int(allowed[splitmix64(self._key(item), position) % len(allowed)])
        if item.sampling.logprobs is None:
            return SampleOutput(token)
        return SampleOutput(token, 0.0, [(token, 0.0)] if item.sampling.logprobs > 0 else [])
