"""Soak: 2,000 requests of random lengths (prompts of 1-64 tokens, max_tokens 1-16) from 32 concurrent clients,
streaming or not, greedy or seeded sampling, some cancelled by their client mid-way, while one decode worker is
killed (the launcher restarts it and it registers again). Every request finishes or is cleanly cancelled (a client retries what the
killed worker cut, and what was refused with 429/503 + Retry-After, as a real client would); every greedy
output equals the offline engine's (pdserve.llm.LLM in this process); every pool ends at its initial free count.

CI runs 200 requests (~75 s on the 2-core machine; the whole suite must stay well under 15 minutes): 2,000 take ~290 CPU-ms each
here (prefill 130, decode 120, router 25, client 10), about 5 minutes of the 2-core machine. `pytest --soak-full` runs the 2,000; PDSERVE_SOAK_REQUESTS
sets any count (e.g. 20000 for a long soak off CI).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from dataclasses import dataclass

import httpx
import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling import SamplingParams
from pdserve.llm import GenerationOutput
from tests.reliability.cluster import AUTH, MODEL, REPO, Cluster, Proc, cpu_seconds
from tests.reliability.streams import stream_completion

CI_REQUESTS, FULL_REQUESTS = 200, 2000
CONCURRENCY = 32
NUM_PROMPTS = 64  # distinct prompts: the offline reference runs them as one batch; repeats hit the prefix caches
KILL_AT = 0.4  # fraction of requests done when a decode worker is killed
MAX_CUTS = 3  # attempts a dying worker may end with an error before the request counts as failed
RETRY_DEADLINE_S = 120.0  # 429/503 answers are waited out until then, as a client with a deadline would: on a slow
# host the killed worker's replacement can take longer to register than a fixed number of backoffs lasts


@dataclass(frozen=True)
class Spec:
    index: int
    prompt: int  # index into the prompts
    max_tokens: int
    greedy: bool
    stream: bool
    cancel_after_events: int | None = None  # streaming: hang up after this many events
    cancel_after_s: float | None = None  # not streaming: give up after this long


@dataclass
class Outcome:
    spec: Spec
    kind: str = "failed"  # finished | cancelled | failed
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    backoffs: int = 0  # 429 / 503 answers waited out
    cut: int = 0  # attempts a dying worker ended with an error
    error: str = ""


def make_prompts(tokenizer, rng: random.Random) -> list[list[int]]:
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = []
    for _ in range(NUM_PROMPTS):
        length = rng.randint(1, 64)
        start = rng.randrange(len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts


def make_specs(rng: random.Random, num_requests: int) -> list[Spec]:
    specs = []
    for i in range(num_requests):
        stream = rng.random() < 0.5
        cancel = rng.random() < 0.06
        specs.append(Spec(i, rng.randrange(NUM_PROMPTS), rng.randint(1, 16), rng.random() < 0.8, stream,
                          cancel_after_events=rng.randint(1, 3) if cancel and stream else None,
                          cancel_after_s=rng.uniform(0.05, 0.5) if cancel and not stream else None))
    return specs


def expected(reference: GenerationOutput, prompt: list[int], max_tokens: int, tokenizer,
             eos: frozenset[int]) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a greedy request for `max_tokens` of this prompt, from the
    reference's 16 greedy tokens: cut at max_tokens, or at EOS (counted, its text not returned)."""
    ids = reference.token_ids[:max_tokens]
    stop = next((i for i, token in enumerate(ids) if token in eos), None)
    tokens = ids if stop is None else ids[:stop]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detokenizer.add_token(token) for token in tokens) + detokenizer.flush()
    return text, "length" if stop is None else "stop", len(ids) if stop is None else stop + 1


async def attempt(client: httpx.AsyncClient, spec: Spec, prompt: list[int], outcome: Outcome) -> str:
    """One try: "done", "cancelled", "backoff" (429/503: waited out) or "cut" (a worker died under it)."""
    sampling = {"temperature": 0.0} if spec.greedy else {"temperature": 0.8, "seed": spec.index}
    if spec.stream:
        result = await stream_completion(client, prompt, spec.max_tokens, spec.cancel_after_events, **sampling)
        status, error, retry_after = result.status, result.error, result.headers.get("retry-after")
        if spec.cancel_after_events is not None and error is None and result.finish_reason is None:
            return "cancelled"
        outcome.text, outcome.finish_reason = result.text, result.finish_reason
        outcome.completion_tokens = result.completion_tokens
    else:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": spec.max_tokens, **sampling}
        try:
            reply = await asyncio.wait_for(client.post("/v1/completions", json=body), spec.cancel_after_s)
        except TimeoutError:
            return "cancelled"
        status, retry_after = reply.status_code, reply.headers.get("retry-after")
        data = reply.json()
        error = data.get("error")
        if error is None:
            choice = data["choices"][0]
            outcome.text, outcome.finish_reason = choice["text"], choice["finish_reason"]
            outcome.completion_tokens = data["usage"]["completion_tokens"]
    if status in (429, 503):
        outcome.backoffs += 1
        await asyncio.sleep(min(float(retry_after or 1), 1.0) * random.uniform(0.5, 1.0))
        return "backoff"
    if error is not None:
        outcome.cut += 1
        outcome.error = str(error)[:300]
        return "cut"
    return "done"


async def run_one(client: httpx.AsyncClient, spec: Spec, prompts: list[list[int]]) -> Outcome:
    outcome = Outcome(spec)
    deadline = time.monotonic() + RETRY_DEADLINE_S
    while outcome.cut <= MAX_CUTS and time.monotonic() < deadline:
        result = await attempt(client, spec, prompts[spec.prompt], outcome)
        if result in ("done", "cancelled"):
            outcome.kind = "finished" if result == "done" else "cancelled"
            return outcome
    outcome.error += f" (after {outcome.cut} cut attempts and {outcome.backoffs} 429/503 answers)"
    return outcome


async def soak(cluster: Cluster, specs: list[Spec], prompts: list[list[int]]) -> tuple[list[Outcome], dict]:
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    outcomes: list[Outcome] = []
    restart: dict = {}
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120, limits=limits) as client:
        async def client_loop() -> None:
            while not queue.empty():
                spec = queue.get_nowait()
                outcomes.append(await run_one(client, spec, prompts))
                if len(outcomes) % 250 == 0:
                    print(f"soak: {len(outcomes)} of {len(specs)} done", flush=True)
                if len(outcomes) >= KILL_AT * len(specs) and not restart:
                    restart["task"] = asyncio.create_task(asyncio.to_thread(kill_and_replace, cluster, restart))

        await asyncio.gather(*(client_loop() for _ in range(CONCURRENCY)))
        await restart["task"]
    return outcomes, restart


def kill_and_replace(cluster: Cluster, restart: dict) -> None:
    """SIGKILL the busiest decode worker; the launcher restarts it, it registers again and takes work."""
    victim: Proc = max(cluster.live("decode"), key=lambda p: cluster.status(p)["num_running"])
    restart["killed"] = victim.name
    restart["running_on_victim"] = cluster.status(victim)["num_running"]
    restart["old_pid"] = victim.pid
    started = time.monotonic()
    cluster.retire(victim)
    cluster.wait_deployment()
    restart["replacement_ready_s"] = time.monotonic() - started


def soak_size(config: pytest.Config) -> int:
    default = FULL_REQUESTS if config.getoption("--soak-full") else CI_REQUESTS
    return int(os.environ.get("PDSERVE_SOAK_REQUESTS", default))


def test_soak(healthy: Cluster, reference_llm, pytestconfig: pytest.Config) -> None:
    cluster = healthy
    num_requests = soak_size(pytestconfig)
    rng = random.Random(20240607)
    tokenizer = reference_llm.tokenizer
    prompts = make_prompts(tokenizer, rng)
    specs = make_specs(rng, num_requests)
    reference_s = time.monotonic()
    references = reference_llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    reference_s = time.monotonic() - reference_s
    for prompt, reference in zip(prompts, references, strict=True):  # the truncation rule, checked in full
        assert expected(reference, prompt, 16, tokenizer, reference_llm.eos_token_ids)[0] == reference.text

    cpu_before = {p.pid: cpu_seconds(p.pid) for p in [cluster.router, *cluster.live()]}
    own_before = time.process_time()
    started = time.monotonic()
    outcomes, restart = asyncio.run(soak(cluster, specs, prompts))
    seconds = time.monotonic() - started
    by_role = collections.Counter({"client": time.process_time() - own_before})
    for proc in [cluster.router, *cluster.live()]:
        by_role[proc.role] += cpu_seconds(proc.pid) - cpu_before.get(proc.pid, 0.0)
    cpu = sum(by_role.values())
    kinds = collections.Counter(o.kind for o in outcomes)
    failed = [(o.spec, o.error) for o in outcomes if o.kind == "failed"]
    assert len(outcomes) == num_requests and not failed, failed[:5]
    mismatched = []
    for o in outcomes:
        if o.kind != "finished":
            continue
        if o.spec.greedy:
            want = expected(references[o.spec.prompt], prompts[o.spec.prompt], o.spec.max_tokens, tokenizer,
                            reference_llm.eos_token_ids)
            if (o.text, o.finish_reason, o.completion_tokens) != want:
                mismatched.append((o.spec, (o.text, o.finish_reason, o.completion_tokens), want))
        else:
            assert o.finish_reason in ("stop", "length") and 1 <= o.completion_tokens <= o.spec.max_tokens
    assert not mismatched, mismatched[:3]
    statuses = cluster.wait_idle()
    assert len(cluster.live("decode")) == 2 and cluster.workers[restart["killed"]].pid != restart["old_pid"]
    assert {w["worker_id"] for w in cluster.registry()} == set(statuses)
    greedy = sum(o.kind == "finished" and o.spec.greedy for o in outcomes)
    print(f"\nRELIABILITY soak: offline reference of {NUM_PROMPTS} prompts in {reference_s:.0f} s; "
          f"{num_requests} requests in {seconds:.0f} s ({num_requests / seconds:.1f} req/s, "
          f"{CONCURRENCY} clients): {kinds['finished']} finished, {kinds['cancelled']} cancelled by their client, "
          f"0 failed; {greedy} greedy outputs equal to the offline engine's; decode worker {restart['killed']} "
          f"killed with {restart['running_on_victim']} running ({sum(o.cut for o in outcomes)} attempts cut, "
          f"retried), restarted by the launcher and registered {restart['replacement_ready_s']:.1f} s later; "
          f"{sum(o.backoffs for o in outcomes)} 429/503 answers waited out; every pool at its initial free count; "
          f"{cpu:.0f} CPU-s in all ({1000 * cpu / num_requests:.0f} ms per request: "
          + ", ".join(f"{role} {1000 * value / num_requests:.0f}" for role, value in by_role.most_common())
          + "; the killed worker's not counted)")
