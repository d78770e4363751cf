"""Where a CPU decode step goes, before and after the faster attention / block-copy references, in one run;
and how a served decode step compares with the same step in process.

    .venv/bin/python benchmarks/decode_step_cpu.py [--threads 1] [--repeats 7] [--served] \
        [--out benchmarks/results/decode_step_cpu.json]

Default model (SmolLM2-135M, fp32), one torch thread (what `pdserve serve` gives each of two workers on two
cores), contexts of 200-264 tokens in blocks scattered over the pool as a serving pool scatters them:
  attention   decode_attention_ref per layer call: `legacy` (fancy-index gathers + two einsums, the reference
              before 2026-11-29) against the current one (index_select + SDPA);
  block_copy  gather_blocks / scatter_blocks refs (KV transfer: P's step thread, D's event loop): `legacy`
              (`kv[:, ids]` indexing) against index_select / index_copy_;
  step        runner.decode + sampler, legacy attention against current, wall and step-thread CPU time;
  served      (--served) `pdserve serve`, N requests at once for N in --served-batches, 64 tokens each: the
              decode worker's mean step (its /metrics: wall time by phase, forward CPU time) against the
              in-process step of the same batch. Wall well above CPU means the step thread waited for a core.
Variants alternate within every repeat, so a busy neighbour slows both alike; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from serving_common import Deployment, decode_counters, machine_load, step_summary

from pdserve import kernels
from pdserve.bench.client import ApiTarget
from pdserve.bench.datasets import LengthSpec, sample_random
from pdserve.bench.runner import LoadSpec, run_benchmark
from pdserve.engine.attention_metadata import DecodeInput
from pdserve.engine.config import CacheConfig
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingParams, SamplingRequest
from pdserve.engine.weights import DEFAULT_MODEL, ModelSpec, load_model
from pdserve.engine.weights.fetch import default_cache_dir
from pdserve.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdserve.kernels.decode_attention import decode_attention_ref

NUM_BLOCKS = 1456  # what a CPU worker allocates by default
CONTEXT = (200, 264)


def legacy_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """kernels.decode_attention_ref as it was: fancy-index gathers, einsums over [B, L, Hkv, D]."""
    batch, num_heads, dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].long()
    length = num_blocks * block_size
    k = kv_cache[0, blocks].reshape(batch, length, num_kv_heads, dim).float()
    v = kv_cache[1, blocks].reshape(batch, length, num_kv_heads, dim).float()
    qg = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, dim=-1), v).reshape(batch, num_heads, dim)
    return torch.where(seq_lens[:, None, None] > 0, out, 0.0).to(q.dtype)


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and thread-CPU ms of each fn, the fns alternating within each repeat (one warm-up each)."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - t)
    return {name: {"wall_ms": 1000 * statistics.median(wall[name]), "cpu_ms": 1000 * statistics.median(cpu[name]),
                   "min_wall_ms": 1000 * min(wall[name])} for name in fns}


def scattered_tables(batch: int, gen: torch.Generator, block_size: int) -> tuple[list[int], list[list[int]]]:
    lens = torch.randint(CONTEXT[0], CONTEXT[1] + 1, (batch,), generator=gen).tolist()
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(free[used:used + need])
        used += need
    return lens, tables


def bench_attention(config, batches: list[int], repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    bs, hkv, d = 16, config.num_kv_heads, config.head_dim
    kv = torch.randn(2, NUM_BLOCKS, bs, hkv, d, generator=gen)
    out = {}
    for batch in batches:
        lens, tables = scattered_tables(batch, gen, bs)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(batch, config.num_heads, d, generator=gen)
        args = (q, kv, seq_lens, table, d**-0.5)
        torch.testing.assert_close(decode_attention_ref(*args), legacy_decode_attention(*args), atol=1e-5, rtol=1e-5)
        out[batch] = timed({"legacy": functools.partial(legacy_decode_attention, *args),
                            "current": functools.partial(decode_attention_ref, *args)}, 5 * repeats)
    return out


def _gather_legacy(kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return kv[:, ids].contiguous()


def bench_block_copy(config, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, NUM_BLOCKS, 16, config.num_kv_heads, config.head_dim, generator=gen)
    out = {}
    for n in (13, 289):  # one layer of a 200-token prompt; of 17 such prompts
        ids = torch.randperm(NUM_BLOCKS, generator=gen)[:n]
        blocks = kv[:, ids].contiguous()
        assert torch.equal(gather_blocks_ref(kv, ids), blocks)
        out[n] = timed({"gather_legacy": functools.partial(_gather_legacy, kv, ids),
                        "gather_current": functools.partial(gather_blocks_ref, kv, ids),
                        "scatter_legacy": functools.partial(kv.__setitem__, (slice(None), ids), blocks),
                        "scatter_current": functools.partial(scatter_blocks_ref, kv, ids, blocks)}, 5 * repeats)
    return out


def step_inputs(runner: ModelRunner, batch: int, seed: int) -> tuple[list[DecodeInput], list[SamplingRequest]]:
    lens, tables = scattered_tables(batch, torch.Generator().manual_seed(seed), runner.cache_config.block_size)
    items = [DecodeInput(100 + i, n - 1, t) for i, (n, t) in enumerate(zip(lens, tables, strict=True))]
    requests = [SamplingRequest(SamplingParams(temperature=0.0), [1] * n, []) for n in lens]
    return items, requests


def _step(runner: ModelRunner, sampler: Sampler, items: list[DecodeInput], requests: list[SamplingRequest],
          attention: Callable) -> None:
    """One decode step (forward + sampling) with `attention` as the model's decode attention."""
    current, kernels.decode_attention = kernels.decode_attention, attention
    try:
        sampler(runner.decode(items), requests)
    finally:
        kernels.decode_attention = current


def bench_step(runner: ModelRunner, batches: list[int], repeats: int) -> dict:
    sampler, current = Sampler("cpu"), kernels.decode_attention
    out = {}
    for batch in batches:
        items, requests = step_inputs(runner, batch, seed=batch)
        out[batch] = timed({"legacy": functools.partial(_step, runner, sampler, items, requests, legacy_decode_attention),
                            "current": functools.partial(_step, runner, sampler, items, requests, current)}, repeats)
        print(f"step batch {batch}: " + ", ".join(f"{k} {v['wall_ms']:.0f} ms" for k, v in out[batch].items()),
              flush=True)
    return out


def bench_served(runner: ModelRunner, batches: list[int], repeats: int, port: int) -> dict:
    """Served decode steps at (about) each batch against the in-process step of that batch."""
    out, sampler = {}, Sampler("cpu")
    with tempfile.TemporaryDirectory() as tmp, Deployment(port, [], Path(tmp) / "serve.log") as dep:
        target, decode_url = ApiTarget(dep.url, model=dep.model(), ignore_eos=True), dep.worker_url("decode")
        for batch in batches:
            # prompts of 180-220 tokens plus 0-64 generated: the in-process contexts (200-264) on average
            convs = sample_random(batch, LengthSpec(200, 0.1), LengthSpec(64), None, seed=batch)
            before, load = decode_counters(decode_url), machine_load()
            asyncio.run(run_benchmark(convs, target, LoadSpec(math.inf), progress=False))
            served = step_summary(before, decode_counters(decode_url))
            items, requests = step_inputs(runner, round(served["mean_batch"]), seed=batch)
            local = timed({"in_process": functools.partial(_step, runner, sampler, items, requests,
                                                           kernels.decode_attention)}, repeats)
            out[batch] = {"served": served, "in_process": local["in_process"], "load": load,
                          "wall_ratio": served["step_ms"] / local["in_process"]["wall_ms"],
                          "forward_cpu_ratio": served["forward_cpu_ms"] / local["in_process"]["cpu_ms"]}
            print(f"served batch {served['mean_batch']:.1f}: step {served['step_ms']:.0f} ms (forward CPU "
                  f"{served['forward_cpu_ms']:.0f}) vs in process {local['in_process']['wall_ms']:.0f} ms", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 8, 17, 32])
    parser.add_argument("--served", action="store_true", help="also serve and compare served steps")
    parser.add_argument("--served-batches", type=int, nargs="+", default=[2, 17])
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--out", default="benchmarks/results/decode_step_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelSpec(DEFAULT_MODEL, "auto"), torch.float32, "cpu", default_cache_dir())
    runner = ModelRunner(loaded.config, CacheConfig(NUM_BLOCKS, 16), loaded.weights, "cpu", torch.float32,
                         max_num_seqs=max(args.batches + args.served_batches))
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["benchmarks/decode_step_cpu.py",
              *sys.argv[1:]]), "threads": args.threads, "load_at_start": machine_load(),
              "attention_per_layer": bench_attention(loaded.config, args.batches, args.repeats),
              "block_copy": bench_block_copy(loaded.config, args.repeats)}
    report["step"] = bench_step(runner, args.batches, args.repeats)
    if args.served:
        report["served"] = bench_served(runner, args.served_batches, args.repeats, args.port)
    report["load_at_end"] = machine_load()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    print(f"\n{'batch':>6} {'attention/layer legacy → now (ms)':>36} {'step legacy → now (ms)':>28}")
    for batch, step in report["step"].items():
        att = report["attention_per_layer"][batch]
        print(f"{batch:>6} {att['legacy']['wall_ms']:>22.2f} → {att['current']['wall_ms']:<10.2f} "
              f"{step['legacy']['wall_ms']:>17.0f} → {step['current']['wall_ms']:<8.0f}")
    for n, copy in report["block_copy"].items():
        print(f"{n} blocks: gather {copy['gather_legacy']['wall_ms']:.2f} → {copy['gather_current']['wall_ms']:.2f} ms, "
              f"scatter {copy['scatter_legacy']['wall_ms']:.2f} → {copy['scatter_current']['wall_ms']:.2f} ms")
    load = report["load_at_start"], report["load_at_end"]
    print(f"load average (1 min): {load[0]['load1']:.1f} at start, {load[1]['load1']:.1f} at end")


if __name__ == "__main__":
    raise SystemExit(main())
