"""TTFT with and without KV reuse through the tiered cache (device → host RAM → Redis), on a real deployment.

Starts its own redis-server and `pdserve serve --num-prefill 2 --redis-url ...` (router, 2 prefill workers,
1 decode worker, the default model), then measures, through the official openai client (streaming,
TTFT = request sent → first token received):

    shared prefix   a 1,024-token prefix + a unique 16-token suffix, max_tokens 1:
                    no reuse (a fresh cache_salt per request: no tier can match, everything is computed),
                    device hit (same salt, the prefill worker still holds the prefix),
                    Redis hit (same salt, every prefill worker's device and host caches cleared first)
    conversation    5 turns of a chat (system prompt + each turn's question, 32-token answers, greedy), 3 times
                    over with different salts (medians per turn);
                    before every turn the prefill workers' caches are cleared, so only Redis can help: the
                    history was committed there by the decode worker (prompt + answer) and the prefill worker
                    (prompt). The same turn is also sent with a fresh salt (no reuse) and must give the same text.

Arms are interleaved request by request, so a busy machine slows both alike. Saves JSON (every TTFT, the
machine's load) and prints a table.

    .venv/bin/python benchmarks/cache_reuse.py                     # CPU: ~8 minutes on 2 busy cores
    .venv/bin/python benchmarks/cache_reuse.py --repeats 8 --out benchmarks/results/cache_reuse.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai

from pdserve.launch_plan import free_port
from pdserve.process_group import ProcessGroup, serve_command

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
SECRET = secrets.token_hex(16)  # the deployment's internal API secret: this script calls /internal/* too
INTERNAL = {"X-PDServe-Secret": SECRET}


def start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL)
    return process, f"redis://127.0.0.1:{port}/0"


def start_deployment(redis_url: str, args: argparse.Namespace, log_path: Path) -> tuple[ProcessGroup, str]:
    port = free_port()
    flags = ["--num-prefill", "2", "--redis-url", redis_url, "--cache-timeout", "10", "--num-blocks", "1024",
             "--max-num-batched-tokens", "2048", *args.worker_flags]
    group = ProcessGroup(serve_command(port, flags), log_path, {**os.environ, "PDSERVE_SECRET": SECRET}, cwd=REPO)
    group.start().wait_until(lambda: "pdserve ready" in group.log(1 << 30), 600, "the deployment", poll_s=0.5)
    return group, f"http://127.0.0.1:{port}"


class Bench:
    def __init__(self, url: str) -> None:
        self.url = url
        self.api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        workers = httpx.get(f"{url}/internal/workers", headers=INTERNAL, timeout=10).json()["workers"]
        self.prefill = [w["url"] for w in workers if w["roles"] == ["prefill"]]

    def clear_prefill_caches(self) -> None:
        for url in self.prefill:
            httpx.post(f"{url}/internal/cache/clear", json={"device": True, "host": True}, headers=INTERNAL,
                       timeout=30).raise_for_status()

    def redis_reused_tokens(self) -> int:
        return sum(httpx.get(f"{url}/internal/cache", headers=INTERNAL, timeout=10).json()["stats"]["redis_reused_tokens"]
                   for url in self.prefill)

    def complete(self, prompt: list[int], salt: str) -> dict[str, Any]:
        started = time.perf_counter()
        stream = self.api.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"cache_salt": salt})
        ttft, text, usage = None, "", None
        for chunk in stream:
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - started
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return {"ttft_s": ttft, "text": text, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens}

    def chat(self, messages: list[dict[str, str]], salt: str, max_tokens: int) -> dict[str, Any]:
        started = time.perf_counter()
        stream = self.api.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  extra_body={"cache_salt": salt})
        ttft, text, usage = None, "", None
        for chunk in stream:
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - started
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        return {"ttft_s": ttft, "text": text, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def shared_prefix(bench: Bench, tokenizer: Any, repeats: int) -> dict[str, list[dict[str, Any]]]:
    text = " ".join(f"Clause {i}: the tenant keeps item {i * 7 % 31} away from item {i * 3 % 17}." for i in range(200))
    prefix = tokenizer.encode(text, add_special_tokens=False)[:1024]
    assert len(prefix) == 1024, len(prefix)
    salt = f"shared-{uuid.uuid4().hex}"
    bench.complete(prefix + tokenizer.encode(" Warm-up question.", add_special_tokens=False)[:16], salt)
    arms: dict[str, list[dict[str, Any]]] = {"no_reuse": [], "device_hit": [], "redis_hit": []}
    for i in range(repeats):
        suffix = tokenizer.encode(f" Question {i}: which item is kept away from item {i}? Answer:",
                                  add_special_tokens=False)[:16]
        arms["no_reuse"].append(bench.complete(prefix + suffix, f"fresh-{uuid.uuid4().hex}"))
        arms["device_hit"].append(bench.complete(prefix + suffix, salt))
        bench.clear_prefill_caches()
        before = bench.redis_reused_tokens()
        arms["redis_hit"].append(bench.complete(prefix + suffix, salt) | {
            "redis_reused_tokens": bench.redis_reused_tokens() - before})
        for arm in arms:
            row = arms[arm][-1]
            print(f"  prefix {i} {arm:>10}: TTFT {row['ttft_s'] * 1000:8.1f} ms, cached {row['cached_tokens']}",
                  flush=True)
    return arms


def conversation(bench: Bench, turns: int, answer_tokens: int, samples: int) -> dict[str, list[list[dict[str, Any]]]]:
    """Per turn, `samples` rows per arm: that many conversations of the same (greedy) text, each with its own
    salt, so every one reuses only its own history."""
    system = " ".join(f"Rule {i}: answer briefly and mention the number {i * 11 % 23}." for i in range(24))
    messages = [{"role": "system", "content": system}]
    salts = [f"chat-{uuid.uuid4().hex}" for _ in range(samples)]
    arms: dict[str, list[list[dict[str, Any]]]] = {"no_reuse": [], "redis": []}
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn + 1}: tell me one short fact about the number "
                                                    f"{turn * 7 + 3}, then name a colour."})
        arms["redis"].append([])
        arms["no_reuse"].append([])
        for salt in salts:
            bench.clear_prefill_caches()  # only Redis can help: the history is not on any prefill worker
            before = bench.redis_reused_tokens()
            reused = bench.chat(messages, salt, answer_tokens)
            reused["redis_reused_tokens"] = bench.redis_reused_tokens() - before
            fresh = bench.chat(messages, f"fresh-{uuid.uuid4().hex}", answer_tokens)
            if fresh["text"] != reused["text"]:
                raise SystemExit(f"turn {turn + 1}: the text with reuse differs from the text without:\n"
                                 f"{reused['text']!r}\n{fresh['text']!r}")
            arms["redis"][-1].append(reused)
            arms["no_reuse"][-1].append(fresh)
            print(f"  turn {turn + 1}: prompt {reused['prompt_tokens']} tokens; TTFT no reuse "
                  f"{fresh['ttft_s'] * 1000:.0f} ms, Redis {reused['ttft_s'] * 1000:.0f} ms "
                  f"(cached {reused['cached_tokens']})", flush=True)
        messages.append({"role": "assistant", "content": arms["redis"][-1][0]["text"]})
    return arms


def load_average() -> list[float]:
    return list(os.getloadavg())


def table(prefix: dict[str, list[dict[str, Any]]], chat: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    def median_ms(rows: list[dict[str, Any]]) -> float:
        return statistics.median(r["ttft_s"] for r in rows) * 1000

    base = median_ms(prefix["no_reuse"])
    lines = ["| 1,024-token shared prefix (+16 new tokens) | median TTFT | vs no reuse | cached tokens |",
             "|---|---|---|---|"]
    for arm in ("no_reuse", "device_hit", "redis_hit"):
        rows = prefix[arm]
        lines.append(f"| {arm} | {median_ms(rows):.0f} ms | {base / median_ms(rows):.1f}x | "
                     f"{statistics.median(r['cached_tokens'] for r in rows):.0f} |")
    lines += ["", ("| conversation turn | prompt tokens | median TTFT no reuse | median TTFT, Redis (caches cleared) "
                  "| speed-up | cached |"), "|---|---|---|---|---|---|"]
    for turn, (fresh, reused) in enumerate(zip(chat["no_reuse"], chat["redis"], strict=True), 1):
        lines.append(f"| {turn} | {reused[0]['prompt_tokens']} | {median_ms(fresh):.0f} ms | {median_ms(reused):.0f} ms "
                     f"| {median_ms(fresh) / median_ms(reused):.1f}x | {reused[0]['cached_tokens']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=3, help="conversations per turn's median")
    parser.add_argument("--worker-flags", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for every worker (last on the line), e.g. --torch-threads 1")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/cache_reuse.json")
    args = parser.parse_args()

    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.engine.weights.fetch import default_cache_dir, fetch_default_model

    cache_dir = os.environ.get("PDSERVE_CACHE_DIR")
    tokenizer = Tokenizer.from_dir(fetch_default_model(Path(cache_dir) if cache_dir else default_cache_dir(),
                                                       progress=False))
    redis_process, redis_url = start_redis()
    log_path = Path(f"/tmp/cache_reuse_{os.getpid()}.log")
    load_before = load_average()
    deployment, url = start_deployment(redis_url, args, log_path)
    try:
        bench = Bench(url)
        print(f"deployment up at {url}; load average {load_before}", flush=True)
        started = time.time()
        prefix = shared_prefix(bench, tokenizer, args.repeats)
        chat = conversation(bench, args.turns, args.answer_tokens, args.conversations)
        elapsed = time.time() - started
    finally:
        deployment.stop(grace_s=30)
        redis_process.terminate()
    lines = table(prefix, chat)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {"cpus": os.cpu_count(), "device": "cpu",
              "load_average_before": load_before, "load_average_after": load_average()},
              "deployment": "router + 2 prefill + 1 decode, redis-server on loopback, --cache-timeout 10",
              "model": MODEL, "elapsed_s": elapsed, "shared_prefix": prefix, "conversation": chat,
              "table": lines}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    print(f"saved {args.out}; load average before {load_before}, after {result['machine']['load_average_after']}")


if __name__ == "__main__":
    main()
