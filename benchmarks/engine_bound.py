"""The engine-bound figure of a serving workload: how fast the engine alone would serve the same lengths,
from its own step times, measured on this device in the same run as the serving benchmark.

    table = measure_steps(preset)               decode graph steps per (batch, context), packed-prefill rate
    bound = replay(lengths, table, max_num_seqs) all requests at once, continuous batching at zero overhead

Replay: requests enter the running batch in order as slots free, each after its prompt's prefill (prompt
tokens / the measured packed-prefill rate: P and D share the one GPU, so prefill and decode time add); P's
prefill samples the first token, so a request of n output tokens then runs n - 1 decode steps. A step of b
rows at mean context c costs the measured CUDA-graph step, interpolated linearly between the measured
batches and contexts (measured at the engine's own buckets, so padding is priced in). No router, no host
work around the step, no KV transfer: what the system around the engine could at best reach.
"""

from __future__ import annotations

import argparse
import bisect
import json
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights

BATCHES = (1, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
CONTEXTS = (128, 512, 1024)
BLOCK = 16


@dataclass(frozen=True)
class StepTable:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_ms: dict[str, float]  # "b{batch}_ctx{context}" -> ms
    prefill_tokens_per_s: float

    def step_ms(self, batch: float, context: float) -> float:
        """Linear in batch, then in context, clamped to the measured range."""
        by_context = [self._along_batches(batch, c) for c in self.contexts]
        return _interpolate(list(self.contexts), by_context, context)

    def _along_batches(self, batch: float, context: int) -> float:
        return _interpolate(list(self.batches), [self.decode_ms[f"b{b}_ctx{context}"] for b in self.batches], batch)

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "contexts": list(self.contexts), "decode_ms": self.decode_ms,
                "prefill_tokens_per_s": self.prefill_tokens_per_s}

    @classmethod
    def from_dict(cls, data: dict) -> StepTable:
        return cls(tuple(data["batches"]), tuple(data["contexts"]), data["decode_ms"], data["prefill_tokens_per_s"])


def measure_in_subprocess(preset: str, out: Path) -> StepTable:
    """`measure_steps` in a process of its own: its GPU memory is surely back when it exits (in-process, the
    deployments started next found 50 GB still held)."""
    subprocess.run([sys.executable, __file__, "--preset", preset, "--out", str(out)], check=True)
    return StepTable.from_dict(json.loads(out.read_text()))


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    x = min(max(x, xs[0]), xs[-1])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0


def _time_ms(fn, repeat: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_steps(preset: str, prefill_batch: tuple[int, int] = (16, 128)) -> StepTable:
    """Decode graph steps and the packed-prefill rate of the dummy `preset` in bf16 on this GPU; the KV pool is
    filled with random values first (never time zeros). The GPU memory it took is free again on return."""
    config = get_preset(preset)
    blocks = max(BATCHES) * _blocks(max(CONTEXTS) + 1) + 1
    runner = ModelRunner(config, CacheConfig(num_blocks=blocks, block_size=BLOCK),
                         dummy_weights(config, torch.bfloat16, "cuda"), "cuda", torch.bfloat16,
                         max_num_seqs=max(BATCHES))
    table = _measure(runner, prefill_batch)
    runner = None
    torch.cuda.empty_cache()
    return table


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _measure(runner: ModelRunner, prefill_batch: tuple[int, int]) -> StepTable:
    for cache in runner.kv_caches:
        cache.normal_()
    per_row, vocab = _blocks(max(CONTEXTS) + 1), runner.config.vocab_size
    decode_ms = {}
    for context in CONTEXTS:
        for batch in BATCHES:
            items = [DecodeInput(11 + i, context, list(range(i * per_row, i * per_row + _blocks(context + 1))))
                     for i in range(batch)]
            decode_ms[f"b{batch}_ctx{context}"] = _time_ms(lambda items=items: runner.decode(items))
    rows, length = prefill_batch
    chunks = [PrefillChunk([(7 * j + i) % vocab for j in range(length)], 0,
                           list(range(i * per_row, i * per_row + _blocks(length)))) for i in range(rows)]
    prefill_ms = _time_ms(lambda: runner.prefill(chunks), repeat=10)
    return StepTable(BATCHES, CONTEXTS, decode_ms, rows * length / (prefill_ms / 1000))


def replay(lengths: list[tuple[int, int]], table: StepTable, max_num_seqs: int,
           cached: list[int] | None = None) -> dict:
    """(prompt tokens, output tokens) per request, all at once -> duration, output tok/s, mean decode batch.
    `cached`: tokens of each request's prompt whose KV is already there (a reused history): not prefilled, but
    part of the context its decode steps attend over."""
    waiting = deque(zip(lengths, cached or [0] * len(lengths)))
    running: list[list[int]] = []  # [context, decode steps left]
    clock = steps = rows = 0.0
    started = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            (prompt, output), reused = waiting.popleft()
            clock += (prompt - reused) / table.prefill_tokens_per_s
            if output > 1:
                running.append([prompt + 1, output - 1])
        if not running:
            continue
        context = sum(r[0] for r in running) / len(running)
        clock += table.step_ms(len(running), context) / 1000
        steps, rows = steps + 1, rows + len(running)
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    output_tokens = sum(o for _, o in lengths)
    return {"duration_s": clock, "output_tokens": output_tokens, "output_tok_s": output_tokens / clock,
            "mean_decode_batch": rows / max(steps, 1), "decode_steps": steps,
            "replay_wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description="the engine's step table (decode graph steps, packed prefill)")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(measure_steps(args.preset).to_dict(), indent=1))


if __name__ == "__main__":
    main()
