"""The tiered KV cache end to end: a real redis-server, `pdserve serve --num-prefill 2 --redis-url ...` (router,
two prefill workers, one decode worker, each with a host RAM tier), the official openai client, greedy outputs.

One deployment for the module, started once; the tests run in file order and share it:
    tiers        the same prompt hits the device, then host RAM, then (on the other P) Redis: same text each time
    sharing      16 requests with one 512-token system prompt compute >= 90% fewer prompt tokens after the first
    salts        another cache_salt shares nothing (no hit, separate Redis keys, no salt in a key name), same text
    redis down   Redis killed while requests run: all succeed, errors are counted; Redis back: used again
    policy       the admin API's cache policy reaches both prefill workers' tiers
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.e2e.deployments import INTERNAL, MODEL, Deployment, launch

ADMIN_TOKEN = "kv-cache-e2e-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_TOKENS = 8
# host tier of ~140 blocks per worker (737 KB per 16-token block of SmolLM2-135M in fp32); lookups may take up to
# 5 s on a loaded 2-core machine (the 0.5 s default would give up on a 40-block Redis read there)
# --local-prefill-threshold 0: every prompt through a prefill worker's tiers (a repeated prompt would otherwise be
# prefilled on the decode worker that holds it: conditional disaggregation)
CACHE_FLAGS = ["--host-cache-gb", "0.1", "--cache-timeout", "5", "--local-prefill-threshold", "0"]


@pytest.fixture(scope="module")
def redis_kv(redis_server_factory):
    return redis_server_factory()


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, default_model_dir: Path,
           redis_kv) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("kv_cache")
    deployment = launch("kv-cache", ["--num-prefill", "2", "--redis-url", redis_kv.url, *CACHE_FLAGS], tmp,
                        model_cache_dir, env={"PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


def prefill_urls(deployment: Deployment) -> dict[str, str]:
    return {w["worker_id"]: w["url"] for w in deployment.workers if w["roles"] == ["prefill"]}


def tier_stats(deployment: Deployment) -> dict[str, dict]:
    return {wid: httpx.get(f"{url}/internal/cache", headers=INTERNAL, timeout=10).json()["stats"]
            for wid, url in prefill_urls(deployment).items()}


def served_by(before: dict[str, dict], after: dict[str, dict]) -> str:
    """The prefill worker that looked a prompt up between two `tier_stats` snapshots."""
    [worker] = [w for w in after if after[w]["device_queried_blocks"] != before[w]["device_queried_blocks"]]
    return worker


def ask(deployment: Deployment, system: str, user: str, salt: str | None,
        max_tokens: int = MAX_TOKENS) -> tuple[str, int, int]:
    """(text, prompt tokens, cached prompt tokens) of one greedy chat completion."""
    with openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=120) as api:
        out = api.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
            max_tokens=max_tokens, temperature=0, extra_body={"cache_salt": salt} if salt is not None else None)
    usage = out.usage
    return out.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def long_text(topic: str, sentences: int) -> str:
    return " ".join(f"Note {i} about {topic}: item {i * 7 % 13} goes before item {i * 5 % 11}." for i in range(sentences))


def clear(deployment: Deployment, worker_id: str, device: bool = True, host: bool = True) -> None:
    url = prefill_urls(deployment)[worker_id]
    httpx.post(f"{url}/internal/cache/clear", json={"device": device, "host": host}, headers=INTERNAL,
               timeout=10).raise_for_status()


def test_device_host_and_redis_hits_on_either_prefill_worker_give_the_same_text(cached: Deployment) -> None:
    system, user = long_text("tiers", 20), "Which item goes first?"
    reference, prompt_tokens, uncached = ask(cached, system, user, salt=f"ref-{uuid.uuid4().hex}")
    assert uncached == 0 and prompt_tokens > 200
    salt = f"tiers-{uuid.uuid4().hex}"
    before = tier_stats(cached)
    assert ask(cached, system, user, salt) == (reference, prompt_tokens, 0)  # computed: the prefix is stored
    computed_on = served_by(before, after := tier_stats(cached))
    reusable = (prompt_tokens - 1) // 16 * 16

    assert ask(cached, system, user, salt) == (reference, prompt_tokens, reusable)
    before, after = after, tier_stats(cached)
    assert served_by(before, after) == computed_on, "cache_aware sends it back to the worker holding the prefix"
    assert after[computed_on]["device_reused_tokens"] - before[computed_on]["device_reused_tokens"] == reusable

    clear(cached, computed_on, device=True, host=False)
    assert ask(cached, system, user, salt) == (reference, prompt_tokens, reusable)
    before, after = after, tier_stats(cached)
    assert served_by(before, after) == computed_on
    assert after[computed_on]["host_reused_tokens"] - before[computed_on]["host_reused_tokens"] == reusable

    other = next(w for w in prefill_urls(cached) if w != computed_on)
    drained = httpx.post(f"{cached.url}/admin/workers/{computed_on}/drain", json={"exit": False}, headers=AUTH)
    drained.raise_for_status()
    try:
        assert ask(cached, system, user, salt) == (reference, prompt_tokens, reusable)
    finally:
        httpx.post(f"{cached.url}/admin/workers/{computed_on}/resume", headers=AUTH).raise_for_status()
    before, after = after, tier_stats(cached)
    assert served_by(before, after) == other
    assert after[other]["redis_reused_tokens"] - before[other]["redis_reused_tokens"] == reusable


def test_sixteen_requests_sharing_a_system_prompt_compute_ninety_percent_less(cached: Deployment, redis_kv,
                                                                             default_tokenizer) -> None:
    ids = default_tokenizer.encode(long_text("sharing", 60), add_special_tokens=False)[:512]
    system = default_tokenizer.decode(ids)
    salt = f"sharing-{uuid.uuid4().hex}"
    known = redis_keys(redis_kv)
    _, first_prompt, first_cached = ask(cached, system, "Question 0: which item goes first?", salt, max_tokens=1)
    assert first_cached == 0 and first_prompt >= 512
    # the other prefill worker reads the prefix from Redis: let the first prompt's write-through land (it runs in
    # the background; a lookup racing it finds only the blocks written so far, as it should)
    new_keys(redis_kv, known, 512 // 16, timeout_s=30)
    questions = [f"Question {i}: which item comes after item {i}?" for i in range(1, 16)]
    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda q: ask(cached, system, q, salt, max_tokens=1), questions))  # prefill only
    computed = [prompt - hit for _, prompt, hit in answers]
    assert all(hit >= 480 for _, _, hit in answers), answers
    assert sum(computed) / len(computed) <= 0.1 * first_prompt, (first_prompt, computed)


def redis_keys(redis_kv) -> set[bytes]:
    return set(redis.Redis.from_url(redis_kv.url).keys("pdserve:*"))


def new_keys(redis_kv, known: set[bytes], count: int, timeout_s: float = 10.0) -> set[bytes]:
    """Keys beyond `known` once there are at least `count` of them (write-through runs in the background)."""
    deadline = time.monotonic() + timeout_s
    while len(added := redis_keys(redis_kv) - known) < count:
        assert time.monotonic() < deadline, f"{len(added)} of {count} blocks written to Redis"
        time.sleep(0.1)
    return added


def test_another_cache_salt_shares_no_block(cached: Deployment, redis_kv) -> None:
    system, user = long_text("tenants", 12), "Which item goes last?"
    salt_a, salt_b = f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"
    before = redis_keys(redis_kv)
    text_a, prompt_tokens, hit_a = ask(cached, system, user, salt_a)
    blocks = (prompt_tokens - 1) // 16
    a_keys = new_keys(redis_kv, before, blocks)
    assert ask(cached, system, user, salt_b) == (text_a, prompt_tokens, 0), "same tokens, other tenant: no hit"
    b_keys = new_keys(redis_kv, before | a_keys, blocks)  # its own blocks, under keys of its own
    assert hit_a == 0 and ask(cached, system, user, salt_a)[2] > 0
    assert not any(salt.encode() in key for salt in (salt_a, salt_b) for key in a_keys | b_keys)  # names hash it


def redis_errors(deployment: Deployment) -> float:
    total = 0.0
    for url in prefill_urls(deployment).values():
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("pdserve_kv_cache_redis_errors_total "):
                total += float(line.split()[1])
    return total


def test_requests_survive_redis_going_away_and_redis_is_used_again_when_back(cached: Deployment, redis_kv) -> None:
    errors_before = redis_errors(cached)
    system = long_text("outage", 10)
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(ask, cached, system, f"Question {i}?", f"outage-{i}", 2) for i in range(4)]
        time.sleep(0.5)
        redis_kv.stop()  # killed while those run
        during = [pool.submit(ask, cached, system, f"Question {i}?", f"outage-{i}", 2) for i in range(4, 8)]
        answers = [f.result() for f in running + during]
    assert all(text for text, _, _ in answers)
    assert redis_errors(cached) > errors_before, "failed Redis calls are counted"

    redis_kv.start()  # empty again (no persistence), same port
    time.sleep(1.5)  # the tiers skip Redis for 1 s after an error (redis_retry_interval_s)
    salt = f"back-{uuid.uuid4().hex}"
    before = tier_stats(cached)
    text, prompt_tokens, _ = ask(cached, system, "Is Redis back?", salt)
    computed_on = served_by(before, tier_stats(cached))
    new_keys(redis_kv, set(), (prompt_tokens - 1) // 16)  # the restarted Redis was empty: write-through reached it
    clear(cached, computed_on)
    before = tier_stats(cached)
    assert ask(cached, system, "Is Redis back?", salt) == (text, prompt_tokens, (prompt_tokens - 1) // 16 * 16)
    after = tier_stats(cached)
    assert sum(after[w]["redis_reused_tokens"] - before[w]["redis_reused_tokens"] for w in after) > 0


def test_admin_cache_policy_reaches_every_tier(cached: Deployment) -> None:
    answer = httpx.put(f"{cached.url}/admin/cache-policy", json={"host_eviction": "lfu", "redis_ttl_s": 600},
                       headers=AUTH)
    answer.raise_for_status()
    for worker_id, url in prefill_urls(cached).items():
        assert "redis_ttl_s" in answer.json()["workers"][worker_id]["applied"]
        policy = httpx.get(f"{url}/internal/cache", headers=INTERNAL, timeout=10).json()["policy"]
        assert policy["host_eviction"] == "lfu" and policy["redis_ttl_s"] == 600
    refused = httpx.put(f"{cached.url}/admin/cache-policy", json={"write": "sometimes"}, headers=AUTH)
    assert refused.status_code == 400 and "write must be one of" in refused.json()["error"]["message"]
