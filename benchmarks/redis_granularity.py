"""How much KV should one Redis value hold: one block, or a chunk of N blocks? (cache_store/redis_tier.py)

Stores and fetches a 64-block prefix through redis-py (hiredis parser) against a real redis-server on
loopback, for three block sizes and chunk sizes 1, 4 and 16, pipelining `--batch-blocks` blocks' worth of
values per round trip (16 one-block values, 4 four-block values, or 1 sixteen-block value), so every layout
moves the same bytes per round trip. Reports throughput, the time the (single-threaded) server spends on one value, and how much of a
prompt's prefix a chunked layout can store at all (a chunk is usable only whole).

    .venv/bin/python benchmarks/redis_granularity.py                      # starts its own redis-server
    .venv/bin/python benchmarks/redis_granularity.py --redis-url redis://host:6379/0

Block sizes: 64 KiB (a small model), 360 KiB (SmolLM2-135M, bf16, 16 tokens: 30 layers × 2 × 16 × 3 × 64 × 2),
2 MiB (Llama-3-8B, bf16, 16 tokens: 32 × 2 × 16 × 8 × 128 × 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import redis

from pdserve.launch_plan import free_port

BLOCK_BYTES = {"64KiB": 64 << 10, "smollm2_bf16_360KiB": 368_640, "llama3_8b_bf16_2MiB": 2 << 20}
CHUNKS = (1, 4, 16)
PREFIX_BLOCKS = 64


def start_server() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found; pass --redis-url")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    return process, f"redis://127.0.0.1:{port}/0"


def pipelined(client: redis.Redis, ops: list[tuple], batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, len(ops), batch):
        pipe = client.pipeline(transaction=False)
        for op, *args in ops[start:start + batch]:
            getattr(pipe, op)(*args)
        pipe.execute()
    return time.perf_counter() - started


def measure(client: redis.Redis, block_bytes: int, chunk: int, batch_blocks: int, repeats: int) -> dict[str, float]:
    num_values = PREFIX_BLOCKS // chunk
    batch = max(1, batch_blocks // chunk)
    payload = os.urandom(block_bytes * chunk)
    keys = [f"bench:{block_bytes}:{chunk}:{i}" for i in range(num_values)]
    sets, gets = [], []
    for _ in range(repeats):
        sets.append(pipelined(client, [("set", k, payload) for k in keys], batch))
        gets.append(pipelined(client, [("get", k) for k in keys], batch))
    client.delete(*keys)
    total = PREFIX_BLOCKS * block_bytes
    get_s, set_s = statistics.median(gets), statistics.median(sets)
    return {"chunk_blocks": chunk, "value_bytes": block_bytes * chunk, "values": num_values,
            "get_s": get_s, "set_s": set_s, "get_gb_s": total / get_s / 1e9, "set_gb_s": total / set_s / 1e9,
            "get_ms_per_value": 1e3 * get_s / num_values}


def storable_fraction(chunk: int, max_blocks: int = 128) -> float:
    """Mean fraction of a prompt's full blocks that whole chunks cover, prompts of 1..max_blocks blocks."""
    return statistics.mean((b // chunk) * chunk / b for b in range(1, max_blocks + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--batch-blocks", type=int, default=16, help="blocks per pipelined round trip")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "redis_granularity.json"))
    args = parser.parse_args()
    process, url = (None, args.redis_url) if args.redis_url else start_server()
    try:
        client = redis.Redis.from_url(url)
        rows = []
        for name, block_bytes in BLOCK_BYTES.items():
            for chunk in CHUNKS:
                row = {"block": name, "block_bytes": block_bytes, **measure(client, block_bytes, chunk, args.batch_blocks,
                                                                            args.repeats)}
                rows.append(row)
                print(f"{name:>22} chunk {chunk:>2}: get {row['get_gb_s']:.2f} GB/s, set {row['set_gb_s']:.2f} GB/s, "
                      f"{row['get_ms_per_value']:.2f} ms/value")
        result = {"prefix_blocks": PREFIX_BLOCKS, "batch_blocks": args.batch_blocks, "repeats": args.repeats,
                  "hiredis": redis.utils.HIREDIS_AVAILABLE, "cpus": os.cpu_count(), "rows": rows,
                  "storable_fraction_prompts_1_to_128_blocks": {str(c): storable_fraction(c) for c in CHUNKS}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        if process is not None:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
