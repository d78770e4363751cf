"""The cache_aware prefill policy and its per-worker view of cached prefixes (unit level; the end-to-end
behaviour on real workers is in tests/e2e/test_kv_cache.py)."""

from __future__ import annotations

import pytest

from pdserve.cache_store.hashing import block_hashes
from pdserve.protocol.prefix_summary import encode_summary
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CacheAware, Prompt, make_prefill_policy
from pdserve.router.prefix_index import CachedPrefixes
from pdserve.router.registry import Worker, WorkerLoad

FP = "model-fp"
BS = 16
TOKENS = list(range(100, 100 + 10 * BS + 5))  # 10 full blocks + 5 tokens: 10 blocks looked up


def _worker(name: str, holds: int = 0, salt: str | None = None, fingerprint: str | None = FP, **load: int) -> Worker:
    worker = Worker(worker_id=name, url=f"http://{name}", roles=("prefill",), static=False, last_seen=0.0,
                    load=WorkerLoad(**load), fingerprint=fingerprint)
    if holds:
        worker.prefixes.report(encode_summary(block_hashes(TOKENS, BS, FP, salt)[:holds]))
    return worker


def _ids(workers: list[Worker]) -> list[str]:
    return [w.worker_id for w in workers]


def test_longest_cached_prefix_first() -> None:
    policy = CacheAware(BS, max_imbalance=4)
    workers = [_worker("a", holds=3), _worker("b", holds=8), _worker("c")]
    assert _ids(policy.order(workers, len(TOKENS), Prompt(TOKENS))) == ["b", "a", "c"]
    assert policy.matched_blocks(workers[1], Prompt(TOKENS)) == 8


def test_overloaded_holder_loses_to_the_least_loaded() -> None:
    policy = CacheAware(BS, max_imbalance=2)
    holder, idle = _worker("holder", holds=10, queue_len=2), _worker("idle")
    assert _ids(policy.order([holder, idle], len(TOKENS), Prompt(TOKENS)))[0] == "holder"  # 2 <= 0 + 2
    holder.inflight = 1
    assert _ids(policy.order([holder, idle], len(TOKENS), Prompt(TOKENS))) == ["idle", "holder"]


def test_equal_prefixes_go_to_the_least_loaded_then_rotate() -> None:
    policy = CacheAware(BS)
    busy, a, b = _worker("busy", queue_len=1), _worker("a"), _worker("b")
    firsts = [_ids(policy.order([busy, a, b], len(TOKENS), Prompt(TOKENS)))[0] for _ in range(4)]
    assert sorted(set(firsts)) == ["a", "b"] and "busy" not in firsts
    assert policy.order([], 10, Prompt(TOKENS)) == []


def test_salt_and_fingerprint_are_part_of_the_match() -> None:
    policy = CacheAware(BS)
    tenant_a = _worker("a", holds=10, salt="tenant-a")
    assert policy.matched_blocks(tenant_a, Prompt(TOKENS, "tenant-a")) == 10
    assert policy.matched_blocks(tenant_a, Prompt(TOKENS, "tenant-b")) == 0
    assert policy.matched_blocks(tenant_a, Prompt(TOKENS)) == 0
    assert policy.matched_blocks(_worker("static", holds=0, fingerprint=None), Prompt(TOKENS)) == 0


def test_a_routed_prompt_follows_its_worker_before_the_next_heartbeat() -> None:
    policy = CacheAware(BS)
    a, b = _worker("a"), _worker("b")
    first = policy.order([a, b], len(TOKENS), Prompt(TOKENS))[0]
    policy.routed(first, Prompt(TOKENS))
    follow_up = Prompt(TOKENS + [7] * 40)
    assert all(policy.order([a, b], len(follow_up.token_ids), follow_up)[0] is first for _ in range(3))


def test_routed_notes_expire_and_reports_replace() -> None:
    now = [0.0]
    prefixes = CachedPrefixes(routed_ttl_s=5.0, clock=lambda: now[0])
    hashes = block_hashes(TOKENS, BS, FP)
    prefixes.note_routed(hashes[:4])
    assert prefixes.matched(hashes) == 4
    now[0] = 6.0
    assert prefixes.matched(hashes) == 0
    prefixes.report(encode_summary(hashes[:2]))
    assert prefixes.matched(hashes) == 2
    assert prefixes.matched([hashes[0], hashes[5], hashes[1]]) == 1, "a chain stops at the first miss"
    prefixes.report(encode_summary([]))
    assert prefixes.matched(hashes) == 0
    with pytest.raises(ValueError, match="8-byte keys"):
        prefixes.report("AAAA")


def test_cache_aware_is_the_default_and_takes_the_config() -> None:
    config = RouterConfig(model="m", block_size=32, cache_aware_max_imbalance=7)
    policy = make_prefill_policy(config.prefill_policy, config.policy_options)
    assert isinstance(policy, CacheAware) and (policy.block_size, policy.max_imbalance) == (32, 7)
    with pytest.raises(ValueError, match="cache_aware_max_imbalance must be >= 0, got -1"):
        RouterConfig(model="m", cache_aware_max_imbalance=-1)
