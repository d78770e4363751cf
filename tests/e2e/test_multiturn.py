"""Multi-turn conversations through real `pdserve serve` deployments (router + 1 P + 1 D, the official openai
client, greedy): every turn's text equals the offline engine's on each path the second and later turns can take,
what P sends to D shrinks to the new turn's blocks, and no block stays held once the turns are answered.

    today      `--no-decode-prefix-cache --local-prefill-threshold 0`: D keeps no prefix of its own for
               reservations; P sends every turn's whole prompt
    delta      the defaults, a turn whose new part is long (> --local-prefill-threshold 256 tokens): D reserves the
               history it holds from the last turn, P computes the turn and sends only the blocks after it
    local      the defaults, a turn whose new part is short: the router sends it to the D holding the history,
               which prefills the rest itself; P computes and sends nothing
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.engine.sampling import SamplingParams
from tests.e2e.deployments import INTERNAL, MODEL, Deployment, launch

MAX_TOKENS = 16
SYSTEM = "You are a concise assistant."
FIRST = "Name three rivers of Europe."
LONG = " ".join(f"Fact {i}: the river number {i} flows {i * 3 % 7} km past town {i * 5 % 11}." for i in range(24))
SHORT = "Which is the longest?"


@pytest.fixture(scope="module")
def today(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
          default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("multiturn-today", ["--no-decode-prefix-cache", "--local-prefill-threshold", "0"],
                        tmp_path_factory.mktemp("multiturn"), model_cache_dir)
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


def counters(deployment: Deployment, role: str) -> dict[str, float]:
    """The worker's Prometheus counters (names without `_total`), and the router's."""
    url = deployment.worker_url(role) if role != "router" else deployment.url
    values = {}
    for line in httpx.get(f"{url}/metrics", headers=INTERNAL, timeout=10).text.splitlines():
        if line.startswith("pdserve_") and " " in line:
            name, _, value = line.rpartition(" ")
            values[name.replace("_total", "")] = float(value)
    return values


def turn(deployment: Deployment, messages: list[dict[str, str]]) -> dict[str, object]:
    """One greedy chat turn; what it cost P and D (deltas of their counters) with its text."""
    before = {role: counters(deployment, role) for role in ("prefill", "decode", "router")}
    with openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=120) as api:
        reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    after = {role: counters(deployment, role) for role in ("prefill", "decode", "router")}

    def delta(role: str, name: str) -> float:
        return after[role].get(name, 0.0) - before[role].get(name, 0.0)

    return {"text": reply.choices[0].message.content, "prompt_tokens": reply.usage.prompt_tokens,
            "sent_bytes": delta("prefill", "pdserve_prefill_transfer_bytes"),
            "computed_on_p": delta("prefill", "pdserve_prefill_computed_tokens"),
            "reused_on_d": delta("decode", "pdserve_decode_reused_prompt_tokens"),
            "local_on_d": delta("decode", "pdserve_decode_local_prefills"),
            "local_by_router": delta("router", "pdserve_local_prefills")}


def conversation(deployment: Deployment, offline_llm) -> list[dict[str, object]]:
    """Three turns (a first one, one with a long new message, one with a short one); each checked against the
    offline engine on the same messages."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for user in (FIRST, LONG, SHORT):
        messages.append({"role": "user", "content": user})
        ids = offline_llm.tokenizer.encode(offline_llm.tokenizer.apply_chat_template(messages),
                                           add_special_tokens=False)
        expected = offline_llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
        got = turn(deployment, messages)
        assert got["text"] == expected.text, f"{deployment.name} turn {len(turns) + 1}"
        assert got["prompt_tokens"] == len(ids)
        turns.append(got)
        messages.append({"role": "assistant", "content": got["text"]})
    return turns


def assert_nothing_held(deployment: Deployment) -> None:
    """Every block of both workers free or evictable (a finished turn's history stays cached, unreferenced)."""
    for role in ("prefill", "decode"):
        status = deployment.status(role)
        assert status["free_blocks"] == status["total_blocks"], f"{deployment.name} {role}: {status}"


def blocks(tokens: int) -> int:
    return -(-tokens // 16)


def test_today_sends_every_turn_whole(today: Deployment, offline_llm) -> None:
    turns = conversation(today, offline_llm)
    block_bytes = turns[0]["sent_bytes"] / blocks(turns[0]["prompt_tokens"])
    assert block_bytes == 737_280  # SmolLM2-135M in fp32: 2 x 30 layers x 3 heads x 64 x 4 bytes x 16 tokens
    for got in turns:
        assert got["sent_bytes"] == blocks(got["prompt_tokens"]) * block_bytes
        assert got["reused_on_d"] == 0 and got["local_on_d"] == 0 and got["local_by_router"] == 0
    assert_nothing_held(today)


def test_later_turns_send_only_what_d_lacks_or_nothing(disaggregated: Deployment, offline_llm) -> None:
    first, delta, local = conversation(disaggregated, offline_llm)
    block_bytes = 737_280
    assert first["sent_bytes"] == blocks(first["prompt_tokens"]) * block_bytes
    # the long turn: D held at least the first turn's full blocks; P sent the blocks after them, no more
    history = first["prompt_tokens"] + MAX_TOKENS - 1  # tokens the first turn left with KV on D (at most)
    assert delta["local_on_d"] == 0 and delta["reused_on_d"] >= first["prompt_tokens"] // 16 * 16
    assert delta["reused_on_d"] <= history // 16 * 16
    assert delta["sent_bytes"] == (blocks(delta["prompt_tokens"]) - delta["reused_on_d"] // 16) * block_bytes
    assert delta["computed_on_p"] > 0
    # the short turn: D prefilled it itself (the router knew D held the history), P did nothing
    assert local["local_on_d"] == 1 and local["local_by_router"] == 1
    assert local["sent_bytes"] == 0 and local["computed_on_p"] == 0
    assert local["prompt_tokens"] - local["reused_on_d"] < 256
    assert_nothing_held(disaggregated)
