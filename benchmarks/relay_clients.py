"""Streaming clients for benchmarks/router_relay.py: N keep-alive connections, each sending one streaming
completion after another, counting tokens as bytes arrive (no JSON parsing: the fake workers' every token is
"§", which nothing else in an event contains). Prints one JSON line of results.

    python benchmarks/relay_clients.py --url http://127.0.0.1:P --streams 512 --max-tokens 256 \
        --warmup 3 --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

TOKEN = "§".encode()
END = b"0\r\n\r\n"  # the terminal chunk of a chunked response


@dataclass
class Counts:
    window: tuple[float, float]
    tokens: int = 0  # tokens that arrived inside the window
    events: int = 0
    completed: int = 0  # responses that ended inside the window
    failed: int = 0
    reads: int = 0
    first_token_s: list[float] = field(default_factory=list)

    def add(self, now: float, chunk: bytes) -> None:
        if self.window[0] <= now < self.window[1]:
            self.tokens += chunk.count(TOKEN)
            self.events += chunk.count(b"data: {")
            self.reads += 1


async def stream_forever(host: str, port: int, body: bytes, counts: Counts, stop_at: float) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Authorization: Bearer relay\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    try:
        while time.perf_counter() < stop_at:
            sent = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                counts.failed += 1
                await asyncio.sleep(0.1)
                continue
            tail, first = b"", True
            while not tail.endswith(END):
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionError("the router closed the stream")
                now = time.perf_counter()
                if first and TOKEN in chunk:
                    counts.first_token_s.append(now - sent)
                    first = False
                counts.add(now, chunk)
                tail = (tail + chunk)[-len(END):]
            if counts.window[0] <= time.perf_counter() < counts.window[1]:
                counts.completed += 1
    finally:
        writer.close()


async def run(args: argparse.Namespace) -> dict:
    host, port = args.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": args.model, "prompt": "hi", "max_tokens": args.max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    start = time.perf_counter()
    window = (start + args.warmup, start + args.warmup + args.seconds)
    counts = Counts(window)
    tasks = [asyncio.create_task(stream_forever(host, int(port), body, counts, window[1]))
             for _ in range(args.streams)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    ttft = sorted(counts.first_token_s)
    return {"streams": args.streams, "max_tokens": args.max_tokens, "window_s": args.seconds,
            "tokens": counts.tokens, "events": counts.events, "completed": counts.completed, "reads": counts.reads,
            "failed": counts.failed + len(errors), "errors": errors[:3],
            "relay_tokens_per_s": counts.tokens / args.seconds,
            "events_per_s": counts.events / args.seconds,
            "ttft_p50_ms": 1000 * ttft[len(ttft) // 2] if ttft else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
