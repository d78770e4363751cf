"""Time a ModelRunner's prefill iterations and decode steps over a grid of shapes, in process.

Each shape runs once to warm up, then `repeats` times; the median is kept. A progress bar per phase counts the
shapes on stderr (the default CPU grid takes about two minutes). Sequences get distinct KV blocks
(sharing one block table would let every row of a decode batch read the same, cache-hot KV and flatter the
context term). Decode batches come uniform (every sequence ctx long) and mixed (one sequence ctx long, the
others the shortest ctx of the grid), as served batches are: the two tell the Σctx term from the
batch·max(ctx) term (see profile.py)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.runner import ModelRunner
from pdserve.planner.profile import DecodeSample, PrefillSample, Profile, fit_decode, fit_prefill


@dataclass(frozen=True)
class ProfileGrid:
    prefill_lens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024)
    prefill_batches: tuple[int, ...] = (1, 2, 4)
    max_batched_tokens: int = 2048  # prefill shapes above this many tokens are skipped
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_ctxs: tuple[int, ...] = (64, 256, 1024)
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.repeats <= 0 or not self.prefill_lens or not self.decode_batches or not self.decode_ctxs:
            raise ValueError(f"a profile grid needs shapes and repeats > 0, got {self}")

    def blocks_needed(self, block_size: int) -> int:
        prefill = max(b * -(-n // block_size) for n in self.prefill_lens for b in self.prefill_batches)
        decode = max(self.decode_batches) * -(-max(self.decode_ctxs) // block_size)
        return max(prefill, decode) + 1

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(batch, tokens per prompt) pairs within the token budget."""
        return [(b, n) for n in self.prefill_lens for b in self.prefill_batches if b * n <= self.max_batched_tokens]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: allocator, kernels' autotuning, lazy init
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _tables(num_seqs: int, tokens: int, block_size: int) -> list[list[int]]:
    per = -(-tokens // block_size)
    return [list(range(i * per, (i + 1) * per)) for i in range(num_seqs)]


def measure_prefill(runner: ModelRunner, grid: ProfileGrid, progress: bool = False) -> list[PrefillSample]:
    bs, vocab = runner.cache_config.block_size, runner.config.vocab_size
    samples = []
    for batch, n in tqdm(grid.prefill_shapes(), desc="prefill shapes", unit="shape", disable=not progress):
        chunks = [PrefillChunk(token_ids=[(7 * i + j) % vocab for j in range(n)], start_pos=0, block_table=t)
                  for i, t in enumerate(_tables(batch, n, bs))]
        seconds = time_median(functools.partial(runner.prefill, chunks), grid.repeats, runner.device)
        samples.append(PrefillSample((n,) * batch, seconds))
    return samples


def decode_shapes(grid: ProfileGrid) -> list[list[int]]:
    """Each decode batch as its sequences' contexts: uniform ones, then mixed ones (one long, the rest short)."""
    uniform = [[ctx] * batch for ctx in grid.decode_ctxs for batch in grid.decode_batches]
    short = min(grid.decode_ctxs)
    mixed = [[ctx] + [short] * (batch - 1) for ctx in grid.decode_ctxs if ctx > short
             for batch in grid.decode_batches if batch > 1]
    return uniform + mixed


def measure_decode(runner: ModelRunner, grid: ProfileGrid, progress: bool = False) -> list[DecodeSample]:
    bs = runner.cache_config.block_size
    samples = []
    for ctxs in tqdm(decode_shapes(grid), desc="decode shapes", unit="shape", disable=not progress):
        tables = _tables(len(ctxs), max(ctxs), bs)
        items = [DecodeInput(token_id=11, position=ctx - 1, block_table=t[: -(-ctx // bs)])
                 for ctx, t in zip(ctxs, tables, strict=True)]
        seconds = time_median(functools.partial(runner.decode, items), grid.repeats, runner.device)
        samples.append(DecodeSample(len(ctxs), sum(ctxs), seconds, max(ctxs)))
    return samples


def profile_runner(runner: ModelRunner, grid: ProfileGrid, model_name: str, progress: bool = False) -> Profile:
    """Measure both phases and fit them."""
    prefill, decode = measure_prefill(runner, grid, progress), measure_decode(runner, grid, progress)
    dtype_bytes = torch.empty(0, dtype=runner.dtype).element_size()
    return Profile(
        model=model_name,
        device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        kv_bytes_per_token=runner.config.kv_bytes_per_token(dtype_bytes),
        block_size=runner.cache_config.block_size,
        prefill=fit_prefill(prefill),
        decode=fit_decode(decode),
        prefill_samples=prefill,
        decode_samples=decode,
    )
