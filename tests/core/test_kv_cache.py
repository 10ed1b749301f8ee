"""KV-cache manager and the scheduler around it: prefix caching, eviction order, swap and recompute
with cached blocks, n > 1 prompt sharing with copy-on-write."""

from __future__ import annotations

import os
import subprocess
import sys

from scheduler_service.core import block_hash
from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode
from scheduler_service.core.kv_cache_manager import AllocStatus, KVCacheManager, PrefixHit
from scheduler_service.core.outputs import NewRequestData, SchedulerOutput
from scheduler_service.core.request import Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import FakeClock
from tests.support.model_executor import ModelExecutor, token_at

BS = 4


def req(rid: str, prompt: list[int], max_tokens: int = 4, share: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingOptions(max_tokens=max_tokens, ignore_eos=True), 0.0,
                   share_prompt_with=share)


class Run:
    def __init__(self, num_blocks: int = 32, cpu_blocks: int = 0, **config: object) -> None:
        cfg = CoreConfig(watermark=0.0, **config)  # type: ignore[arg-type]
        self.s = Scheduler(cfg, ExecutorLimits(BS, num_blocks, cpu_blocks, max_model_len=512), clock=FakeClock())
        self.ex = ModelExecutor(num_blocks, max(cpu_blocks, 1), BS)
        self.tokens: dict[str, list[int]] = {}
        self.outs: list[SchedulerOutput] = []
        self.new: list[NewRequestData] = []

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.tokens[r.request_id] = []
            self.s.add_request(r)

    def step(self) -> SchedulerOutput:
        return self.complete(self.s.schedule())

    def complete(self, out: SchedulerOutput) -> SchedulerOutput:
        """Run a scheduled step on the executor model and update the scheduler with its result."""
        self.new = out.new_requests()
        for d in self.s.update(out, self.ex.step(out)):
            self.tokens[d.request_id] += d.new_token_ids
        self.outs.append(out)
        return out

    def finish_all(self) -> None:
        for _ in range(1000):
            if not self.s.has_unfinished():
                return
            self.step()
        raise AssertionError("unfinished")

    def expect(self, r: Request) -> list[int]:
        return [token_at(r.request_id, r.num_prompt_tokens + i) for i in range(r.sampling.max_tokens)]


PROMPT = list(range(10, 27))  # 17 tokens: 4 full blocks and one token


def test_a_second_request_takes_the_cached_full_blocks_and_computes_only_the_rest() -> None:
    run = Run()
    a = req("a", PROMPT)
    run.add(a)
    run.finish_all()
    b = req("b", [*PROMPT[:16], 99, 98])
    run.add(b)
    run.step()
    new = run.new[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (16, 2)
    assert run.s.stats().prefix_cache_hits == 16 and run.s.stats().prefix_cache_queries == 17 + 18
    run.finish_all()
    assert run.tokens["b"] == run.expect(b)


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    run = Run()
    run.add(req("a", PROMPT[:16]))
    run.finish_all()
    run.add(req("b", PROMPT[:16]))
    run.step()
    new = run.new[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (12, 4)


def test_caching_off_computes_everything() -> None:
    run = Run(enable_prefix_caching=False)
    run.add(req("a", PROMPT))
    run.finish_all()
    run.add(req("b", PROMPT))
    run.step()
    assert run.new[0].num_computed_tokens == 0
    assert run.s.stats().prefix_cache_hits == 0


def test_freed_blocks_are_evicted_uncached_first_then_least_recently_freed() -> None:
    kv = KVCacheManager(6, 0, BS)
    a, b = req("a", [*list(range(8)), 50]), req("b", [*list(range(100, 108)), 51])
    for r in (a, b):
        kv.admit(r, PrefixHit(), r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    table_a, table_b = list(kv.block_table("a")), list(kv.block_table("b"))
    kv.free(a)
    kv.free(b)
    # a's and b's partial third blocks hold nothing reusable: they go first; then a (freed first),
    # tail before head, then b.
    order = kv.device.allocate(6)
    assert order == [table_a[2], table_b[2], table_a[1], table_a[0], table_b[1], table_b[0]]
    assert kv.device.num_cached == 0


# Python hashes an int to its value modulo 2**61 - 1, so a block starting with token 2**61 and one starting
# with token 1 (the rest equal) are two different blocks whose keys hash alike: a real collision, standing
# in for any collision of a hash, with nothing patched.
COLLIDING = 2**61


def test_two_different_blocks_whose_keys_hash_alike_do_not_share_kv() -> None:
    first, other = [1, 2, 3, 4], [COLLIDING, 2, 3, 4]
    assert hash(tuple(first)) == hash(tuple(other)) and hash((0, tuple(first))) == hash((0, tuple(other)))
    run = Run()
    run.add(req("a", [*first, 5, 6, 7, 8, 9]))
    run.finish_all()
    assert run.s.cached_prefix_tokens(req("q", [*first, 5, 6, 7, 8, 9])) == 8
    b = req("b", [*other, 5, 6, 7, 8, 9])
    assert run.s.cached_prefix_tokens(b) == 0
    hits = run.s.stats().prefix_cache_hits
    run.add(b)
    run.step()
    assert run.new[0].num_computed_tokens == 0 and run.new[0].num_scheduled_tokens == 9
    assert run.s.stats().prefix_cache_hits == hits  # no cached token counted
    run.finish_all()
    assert run.tokens["b"] == run.expect(b)


def test_block_keys_hash_under_the_processs_secret_so_chosen_tokens_cannot_flood_the_cache() -> None:
    """Token ids that collide as a tuple (the cache's keys before) hash apart as packed keys, and the same block
    hashes differently in another process: a client cannot aim many blocks at one chain of the cache's dict."""
    first, other = [1, 2, 3, 4], [COLLIDING, 2, 3, 4]
    assert hash(tuple(first)) == hash(tuple(other))
    assert hash(block_hash.pack_tokens(first)) != hash(block_hash.pack_tokens(other))
    probe = "from scheduler_service.core.block_hash import pack_tokens; print(hash(pack_tokens([1, 2, 3, 4])))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    hashes = {subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                             env=env).stdout for _ in range(3)}
    assert len(hashes) == 3


def test_a_collision_in_the_prefix_does_not_share_the_blocks_after_it() -> None:
    """Two different first blocks whose keys hash alike, then equal tokens: the second blocks hold
    different KV (each attends to its own first block). Identifying a block's prefix by a hash of its
    parent's key would make them one key, and a later request would take the other prompt's block."""
    rest = [5, 6, 7, 8, 9]
    run = Run()
    a, b = req("a", [1, 2, 3, 4, *rest]), req("b", [COLLIDING, 2, 3, 4, *rest])
    run.add(a)
    run.step()
    table_a = run.new[0].block_ids
    run.finish_all()
    run.add(b)
    run.step()
    table_b = run.new[0].block_ids
    assert run.new[0].num_computed_tokens == 0
    run.finish_all()
    c = req("c", [COLLIDING, 2, 3, 4, *rest])
    run.add(c)
    run.step()
    assert run.new[0].num_computed_tokens == 8
    assert run.new[0].block_ids[:2] == table_b[:2]  # b's own blocks, computed after b's first block
    assert table_a[1] not in run.new[0].block_ids
    run.finish_all()
    assert run.tokens["c"] == run.expect(c)


def test_a_hit_on_a_free_cached_block_counts_against_the_free_pool() -> None:
    kv = KVCacheManager(4, 0, BS)
    a = req("a", list(range(9)))
    kv.admit(a, PrefixHit(), 9)
    a.num_computed_tokens = 9
    kv.free(a)
    b = req("b", list(range(9)))
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8 and kv.device.evictable(hit.blocks) == 2
    assert kv.can_admit(hit, 9) is AllocStatus.OK  # 2 cached + 1 fresh of 4 free
    assert kv.can_admit(hit, 9 + 2 * BS) is AllocStatus.LATER


def test_recompute_preemption_refinds_its_own_blocks() -> None:
    run = Run(num_blocks=7, preemption_mode=PreemptionMode.RECOMPUTE)
    a = req("a", list(range(40, 52)), max_tokens=8)  # 3 blocks, grows to 5
    b = req("b", list(range(60, 68)), max_tokens=8)  # 2 blocks, grows to 4
    run.add(a, b)
    preempted = None
    while preempted is None:
        out = run.step()
        preempted = next((rid for rid in out.finished_ids), None)
    victim = run.s.requests[preempted]
    while preempted in {r.request_id for r in run.s.running} or not run.s.running:
        run.step()
    back = None
    while back is None:
        run.step()
        back = next((n for n in run.new if n.request_id == preempted), None)
    # Its own full blocks, minus any the other request's growth evicted since (tail first).
    assert back.num_computed_tokens > 0 and back.num_computed_tokens % BS == 0
    assert back.num_computed_tokens <= (len(back.token_ids) - 1) // BS * BS
    assert victim.num_preemptions == 1
    run.finish_all()
    assert run.tokens["a"] == run.expect(a) and run.tokens["b"] == run.expect(b)


def test_swap_out_of_a_shared_prefix_leaves_the_other_holder_intact() -> None:
    run = Run(num_blocks=8, cpu_blocks=16, preemption_mode=PreemptionMode.SWAP)
    kv = run.s.kv
    a = req("a", [*PROMPT[:12], 1], max_tokens=10)
    run.add(a)
    run.step()
    b = req("b", [*PROMPT[:12], 2], max_tokens=10)
    run.add(b)
    run.step()
    shared = set(kv.block_table("a")) & set(kv.block_table("b"))
    assert len(shared) == 3 and all(kv.device.ref_count(block) == 2 for block in shared)
    while not (out := run.s.schedule()).swapped_out_ids:  # looked at as scheduled, before its update
        run.complete(out)
        assert run.s.has_unfinished()
    [victim] = out.swapped_out_ids
    other = "b" if victim == "a" else "a"
    # The victim's whole table went to the swap pool, its shared blocks included ...
    assert shared <= {src for src, _ in out.swap_out}
    assert len(kv.cpu_table(victim)) == len(out.swap_out) and not kv.block_table(victim)
    # ... and it dropped its own hold only: the other holder still has them, held once, none free.
    assert shared <= set(kv.block_table(other))
    assert all(kv.device.ref_count(block) == 1 for block in shared)
    assert not shared & kv.device.free_blocks()
    assert kv.device.num_used == len(kv.block_table(other))
    run.complete(out)
    run.finish_all()
    assert run.s.stats().num_preemptions_swap > 0
    assert run.tokens["a"] == run.expect(a) and run.tokens["b"] == run.expect(b)
    assert kv.device.num_used == 0 and kv.cpu.num_used == 0


def test_n_siblings_share_the_prompt_and_copy_its_partial_block_once_each() -> None:
    run = Run(num_blocks=40)
    prompt = [*PROMPT, 27]  # 18 tokens: 4 full blocks and 2 in a fifth
    seqs = [req("s0", prompt, max_tokens=6)] + [req(f"s{i}", prompt, max_tokens=6, share="s0") for i in (1, 2, 3)]
    run.add(*seqs)
    run.step()
    assert [n.request_id for n in run.new] == ["s0"]
    second = run.step()
    forks = run.new
    assert [n.request_id for n in forks] == ["s1", "s2", "s3"]
    assert all((n.num_computed_tokens, n.num_scheduled_tokens) == (17, 1) for n in forks)
    leader = run.s.kv.block_table("s0")
    assert all(n.block_ids[:4] == leader[:4] and n.block_ids[4] != leader[4] for n in forks)
    assert sorted(second.copy) == sorted((leader[4], n.block_ids[4]) for n in forks)
    assert run.s.kv.device.ref_count(leader[0]) == 4 and run.s.kv.device.ref_count(leader[4]) == 1
    assert run.s.kv.device.num_used == 5 + 3  # s0's five, one copy per sibling
    run.finish_all()
    for r in seqs:
        assert run.tokens[r.request_id] == run.expect(r)
    assert run.s.kv.device.num_used == 0


def test_a_sibling_whose_source_finished_falls_back_to_the_cache() -> None:
    run = Run()
    a = req("a", PROMPT, max_tokens=1)
    b = req("b", PROMPT, max_tokens=3, share="a")
    run.add(a, b)
    run.step()  # a computes the prompt, samples its one token and finishes
    out = run.step()
    assert [n.request_id for n in run.new] == ["b"] and not out.copy
    assert run.new[0].num_computed_tokens == 16
    run.finish_all()
    assert run.tokens["b"] == run.expect(b)


def test_aborting_a_held_sibling_and_its_source() -> None:
    run = Run()
    a = req("a", PROMPT * 3, max_tokens=3)
    b = req("b", PROMPT * 3, max_tokens=3, share="a")
    c = req("c", PROMPT * 3, max_tokens=3, share="a")
    run.s.config.long_prefill_token_threshold = 8
    run.add(a, b, c)
    run.step()
    assert run.s.stats().num_waiting == 2
    run.s.abort("b")
    run.s.abort("a")
    run.step()
    assert [n.request_id for n in run.new] == ["c"]
    run.finish_all()
    assert run.s.requests == {} and run.s.kv.device.num_used == 0
    assert run.tokens["c"] == run.expect(c)


def test_reset_executor_forgets_every_cached_block() -> None:
    run = Run()
    run.add(req("a", PROMPT))
    run.finish_all()
    assert run.s.kv.device.num_cached == 5  # 17 prompt + 3 computed outputs
    run.s.reset_executor()
    run.ex = ModelExecutor(32, 1, BS)  # the executor lost its state with its cache
    assert run.s.kv.device.num_cached == 0
    run.add(req("b", PROMPT))
    run.step()
    assert run.new[0].num_computed_tokens == 0


def test_cached_prefix_tokens_answers_from_the_cache_for_placement() -> None:
    run = Run()
    assert run.s.cached_prefix_tokens(req("q", PROMPT)) == 0
    run.add(req("a", PROMPT, max_tokens=2))
    run.finish_all()
    assert run.s.cached_prefix_tokens(req("q", PROMPT)) == 16
    assert run.s.cached_prefix_tokens(req("q", PROMPT[:9])) == 8
    assert run.s.cached_prefix_tokens(req("q", [99, *PROMPT[1:]])) == 0
    off = Run(enable_prefix_caching=False)
    off.add(req("a", PROMPT, max_tokens=2))
    off.finish_all()
    assert off.s.cached_prefix_tokens(req("q", PROMPT)) == 0


def test_releasing_a_held_sibling_or_its_source_to_another_executor() -> None:
    run = Run()
    a, b, c = (req(r, PROMPT * 3, max_tokens=2, share=None if r == "a" else "a") for r in "abc")
    run.s.config.long_prefill_token_threshold = 8
    run.add(a, b, c)
    assert run.s.waiting_ids() == ["a", "b", "c"]
    assert run.s.release("b") is b and run.s.waiting_ids() == ["a", "c"]
    run.step()
    assert run.s.release("a") is None  # running: it finishes here
    run.finish_all()
    assert run.tokens["a"] == run.expect(a) and run.tokens["c"] == run.expect(c)
    assert run.s.kv.device.num_used == 0 and run.s.requests == {}


def test_a_block_computed_twice_keeps_its_key_while_the_second_copy_is_held() -> None:
    """Two requests with the same prompt admitted in one step both compute its blocks (#27). When the first
    copy is freed and then evicted, the key stays registered while the identical second copy is held: a third
    request with that prompt still takes 16 tokens from the cache (from the second copy)."""
    run = Run()
    a, b = req("a", PROMPT, max_tokens=2), req("b", PROMPT, max_tokens=40)
    run.add(a, b)
    run.step()
    assert run.s.stats().prefix_cache_hits == 0  # both computed the prompt
    run.step()
    assert "a" not in run.s.requests and "b" in run.s.requests
    free = run.s.kv.device.num_free
    filler = req("filler", [300 + i for i in range((free - 1) * BS)], max_tokens=1)
    run.add(filler)
    run.step()  # the filler takes every free block but one: a's copies are gone
    assert "filler" not in run.s.requests and "b" in run.s.requests
    b_table = list(run.s.kv.block_table("b"))
    c = req("c", PROMPT)
    run.add(c)
    run.step()
    assert run.new[0].num_computed_tokens == 16
    assert run.s.kv.block_table("c")[:4] == b_table[:4]
    run.finish_all()
    assert run.tokens["c"] == run.expect(c) and run.tokens["b"] == run.expect(b)


def test_the_pool_re_points_a_key_to_a_held_duplicate() -> None:
    """DevicePool alone: a key registered by two blocks is found while either is held; freeing the one the key
    names re-points it to the held duplicate (the freed block holds nothing worth keeping, so allocating it
    evicts nothing); a copy computed while the first copy sits free takes the key over."""
    pool = KVCacheManager(4, 0, BS).device
    key = (block_hash.ROOT, block_hash.pack_tokens([1, 2, 3, 4]))
    first, second = pool.allocate(2) or []
    pool.cache(first, key)
    pool.cache(second, key)
    assert pool.lookup(key) == first
    pool.release([first])
    assert pool.lookup(key) == second and pool.num_cached == 1
    rest = pool.allocate(3)  # every free block, first included
    assert rest is not None and first in rest and pool.lookup(key) == second
    pool.release([second])
    assert pool.lookup(key) == second  # free and cached
    pool.cache(rest[0], key)  # a held block computes the same contents: it takes the key over
    assert pool.lookup(key) == rest[0]
    assert pool.allocate(1) == [second] and pool.lookup(key) == rest[0]
    pool.release(rest)
    assert pool.lookup(key) == rest[0] and pool.num_cached == 1


def scoped(rid: str, prompt: list[int], tenant: str = "", salt: str | None = None) -> Request:
    r = req(rid, prompt, max_tokens=2)
    r.tenant, r.cache_salt = tenant, salt
    return r


def test_the_cache_scope_separates_tenants_and_salts() -> None:
    """A prompt cached under one scope (tenant, cache_salt) is found only by requests of that scope (#27):
    another tenant, another salt, a salt where there was none, none where there was one all miss; the same
    tenant and salt hit."""
    run = Run(64)
    run.add(scoped("a", PROMPT, tenant="t1"), scoped("s", PROMPT, salt="x"), scoped("plain", PROMPT))
    run.finish_all()
    assert run.s.stats().prefix_cache_hits == 0  # three scopes: three copies computed
    expected = {("t1", None): 16, ("t2", None): 0, ("t1", "x"): 0, ("", "x"): 16, ("", "y"): 0, ("", None): 16,
                ("", ""): 0, ("x", None): 0}
    for (tenant, salt), hit in expected.items():
        probe = scoped("probe", PROMPT, tenant, salt)
        assert run.s.cached_prefix_tokens(probe) == hit, (tenant, salt)
        before = run.s.stats().prefix_cache_hits
        run.add(probe)
        run.finish_all()
        assert run.s.stats().prefix_cache_hits - before == hit, (tenant, salt)
        assert run.tokens["probe"] == run.expect(probe)
